"""Baton completion engine package."""
