"""HTTP: REST API and exposition."""
