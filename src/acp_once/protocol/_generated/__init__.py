"""Pydantic models generated from the vendored ACP v2 and v1 schemas."""
