"""Baton router package."""
