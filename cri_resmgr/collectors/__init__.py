"""Collectors: one module per source."""
