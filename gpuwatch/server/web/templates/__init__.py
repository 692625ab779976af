"""The dashboard's HTML, written by plain functions (no template engine)."""
