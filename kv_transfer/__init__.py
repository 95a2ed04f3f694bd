"""Baton kv transfer package."""
