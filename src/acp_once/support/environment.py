"""The environment a spawned agent inherits: ours without our own secrets.

A bridged agent, an upgraded v1 agent and every tool they run are other programs: they have
no use for the bearer token clients must present to us, and anything they log or send on
would leak it. `child_environment` is what `acp_once.bridge` and `acp_once.upgrade` start
their children with when the caller gives no environment of its own.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["SECRET_VARIABLES", "child_environment"]

SECRET_VARIABLES = frozenset({"ACP_ONCE_TOKEN"})
"""Our environment variables that carry a secret (the bearer token of `acp-once serve`,
`bridge`, `status` and the clients)."""


def child_environment(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for a child process: `env` as given when it is not None (the caller
    chose it), else this process's environment without `SECRET_VARIABLES`."""
    if env is not None:
        return dict(env)
    return {name: value for name, value in os.environ.items() if name not in SECRET_VARIABLES}
