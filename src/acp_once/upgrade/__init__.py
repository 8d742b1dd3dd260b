"""The upgrade runtime: any v1 stdio agent served as a v2 agent with idempotency keys
(`acp-once agent --runtime v1 -- CMD`). See `acp_once.upgrade.agent`."""

from acp_once.upgrade.agent import UpgradedAgent
from acp_once.upgrade.child import ChildError

__all__ = ["ChildError", "UpgradedAgent"]
