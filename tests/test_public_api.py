"""The public API, pinned: adding, removing or renaming a public name is a decision that edits
this file, never a side effect of moving code."""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

import pytest

import acp_once.client

PUBLIC: dict[str, list[str]] = {
    "acp_once": ["__version__"],
    "acp_once.agent": [
        "STRICT_ENV",
        "Agent",
        "AgentSideConnection",
        "CallContext",
        "ClientPeer",
        "Coordinator",
        "Extension",
        "LocalCoordinator",
        "PromptKeys",
        "SessionAgent",
        "StopReason",
        "Turn",
        "TurnContext",
        "extension",
        "serve",
        "serve_stdio",
    ],
    "acp_once.agent.updates": [
        "ContentLike",
        "agent_message",
        "agent_message_chunk",
        "agent_thought",
        "agent_thought_chunk",
        "check_update",
        "new_message_id",
        "notice",
        "plan",
        "plan_entry",
        "plan_removed",
        "selected_option",
        "session_info",
        "text",
        "tool_call",
        "tool_call_content_chunk",
        "tool_call_update",
        "tool_content",
        "update_kinds",
        "usage_update",
    ],
    "acp_once.client": [
        "AcpClient",
        "AgentPeer",
        "AgentRefused",
        "Backoff",
        "Client",
        "ClientSession",
        "ClientSideConnection",
        "HttpLauncher",
        "Launcher",
        "OutcomeUnknown",
        "Outbox",
        "PromptCancelled",
        "PromptHandle",
        "SessionUpdate",
        "StdioLauncher",
        "Submission",
        "TurnResult",
        "WebSocketLauncher",
        "open_outbox",
    ],
    "acp_once.conformance": [
        "CHECKS",
        "Check",
        "CheckContext",
        "CheckResult",
        "Level",
        "Link",
        "Probe",
        "Report",
        "Status",
        "Target",
        "TargetUnavailable",
        "checks_for",
        "run_suite",
        "write_json",
        "write_junit",
    ],
    "acp_once.storage": [
        "InsertOutcome",
        "InvalidCursor",
        "KeyRecord",
        "MemoryStore",
        "SchemaOutOfDate",
        "SessionExists",
        "SessionMissing",
        "SessionRecord",
        "SessionStore",
        "ShardedStore",
        "SqliteStore",
        "StorageError",
        "TimelineEntry",
        "UNCHANGED",
        "Unchanged",
        "check_store_url",
        "check_store_urls",
        "migrate_database",
        "open_store",
    ],
}


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_the_public_names_are_exactly_these(module: str) -> None:
    exported = importlib.import_module(module).__all__
    assert len(set(exported)) == len(exported), f"{module}.__all__ repeats a name"
    assert sorted(exported) == sorted(PUBLIC[module])


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_every_public_name_is_importable(module: str) -> None:
    namespace: dict[str, object] = {}
    exec(f"from {module} import {', '.join(PUBLIC[module])}", namespace)
    for name in PUBLIC[module]:
        assert namespace[name] is getattr(importlib.import_module(module), name)


def _public_modules(package: ModuleType) -> list[str]:
    return sorted(
        info.name
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + ".")
        if not any(part.startswith("_") for part in info.name.split("."))
    )


@pytest.mark.parametrize("module", _public_modules(acp_once.client))
def test_every_public_client_module_declares_its_names(module: str) -> None:
    imported = importlib.import_module(module)
    exported = getattr(imported, "__all__", None)
    assert exported is not None, f"{module} has no __all__"
    missing = [name for name in exported if not hasattr(imported, name)]
    assert missing == [], f"{module}.__all__ names what it does not define"
