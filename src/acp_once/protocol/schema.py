"""The ACP v2 wire models, stable and unstable methods, with the RFD's `idempotencyKey`.

Generated from the vendored schema (`schema/schema.unstable.json`, a superset of the stable
schema); `acp_once.protocol.retry` records which methods are stable. Field names are
snake_case in Python and camelCase on the wire: always dump with `by_alias=True`.
"""

from acp_once.protocol._generated.unstable import *  # noqa: F403
