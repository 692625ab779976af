"""fleet domain."""
