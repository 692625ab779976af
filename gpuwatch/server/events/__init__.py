"""events domain."""
