"""processes domain."""
