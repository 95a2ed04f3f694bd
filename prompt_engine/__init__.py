"""Baton prompt engine package."""
