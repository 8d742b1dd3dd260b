"""The ACP v1 wire models: what today's editors and agents speak.

Generated from the vendored stable v1 schema (`schema/v1/schema.json`, Apache-2.0, licence
beside it) the same way as the v2 models. v1 has no idempotency keys: a `session/prompt` is
answered at the end of its turn with `{stopReason}`. Field names are snake_case in Python and
camelCase on the wire: always dump with `by_alias=True`.
"""

from acp_once.protocol._generated.v1 import *  # noqa: F403

#: The protocol version number this module describes.
PROTOCOL_VERSION = 1
