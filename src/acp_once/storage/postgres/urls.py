"""Naming a PostgreSQL store: its URL (`postgresql://...?schema=NAME`), its schema, and how
messages describe where it lives (never with a password)."""

from __future__ import annotations

import urllib.parse
from typing import Final

import psycopg
from psycopg.conninfo import conninfo_to_dict

__all__ = ["DEFAULT_SCHEMA", "check_schema", "describe_postgres", "parse_postgres_url"]

DEFAULT_SCHEMA: Final = "acp_once"


def parse_postgres_url(url: str) -> tuple[str, str]:
    """Split a `postgresql://` store URL into (libpq conninfo, schema).

    The schema comes from the acp-once parameter `?schema=NAME` (default `acp_once`), which is
    removed; every other parameter is left to libpq.

    Raises:
        ValueError: the URL is not a `postgresql://` or `postgres://` URL, or the schema is
            empty or too long.
    """
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("postgresql", "postgres"):
        raise ValueError("a PostgreSQL store URL starts with postgresql:// or postgres://")
    query = urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
    schemas = [value for name, value in query if name == "schema"]
    schema = schemas[-1] if schemas else DEFAULT_SCHEMA
    check_schema(schema)
    if not schemas:
        return url, schema
    rest = urllib.parse.urlencode([(n, v) for n, v in query if n != "schema"])
    return urllib.parse.urlunsplit(parts._replace(query=rest)), schema


def check_schema(schema: str) -> None:
    """Raise ValueError unless `schema` can name a PostgreSQL schema (1 to 63 bytes)."""
    if not schema or len(schema.encode()) > 63 or "\x00" in schema:
        raise ValueError("the PostgreSQL schema name must be 1 to 63 bytes long")


def describe_postgres(conninfo: str, schema: str) -> str:
    """Where a store lives, for messages: host, port, database and schema, never a password."""
    try:
        params = conninfo_to_dict(conninfo)
    except psycopg.Error:
        return f"postgresql (schema {schema})"
    host = params.get("host") or params.get("hostaddr") or "localhost"
    port = params.get("port") or 5432
    dbname = params.get("dbname") or params.get("user") or ""
    return f"postgresql://{host}:{port}/{dbname} (schema {schema})"
