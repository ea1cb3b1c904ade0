"""Exports: Prometheus exposition."""
