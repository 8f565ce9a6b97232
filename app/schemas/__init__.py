"""Pydantic schemas of the REST API, one module per resource."""
