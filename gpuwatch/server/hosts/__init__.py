"""hosts domain."""
