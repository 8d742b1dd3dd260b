"""Pydantic models generated from the vendored ACP v2 schema."""
