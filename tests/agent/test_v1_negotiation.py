"""Version negotiation at `initialize`, by the rules of the TypeScript SDK 2.4.0's
`AgentProtocolRouter` (its documentation in `dist/protocol-router.d.ts`): raw frames over an
in-memory connection to a `SessionAgent`, so each rule is checked on what goes on the wire."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from acp_once.agent.reference import ReferenceAgent
from acp_once.protocol import schema as s
from acp_once.protocol import v1
from acp_once.protocol.errors import (
    INVALID_PARAMS,
    INVALID_REQUEST,
    UNSUPPORTED_PROTOCOL_VERSION,
    InvalidParams,
    InvalidRequest,
    UnsupportedProtocolVersion,
)
from acp_once.protocol.initialization import UNKNOWN_IMPLEMENTATION, route_initialize
from acp_once.storage import MemoryStore
from tests.agent.v1_peer import V1_INIT, RawPeer, raw_peer

pytestmark = pytest.mark.anyio

V2_INIT = {"protocolVersion": 2, "info": {"name": "raw", "version": "2"}}


@asynccontextmanager
async def peer(tmp_path: Path) -> AsyncIterator[RawPeer]:
    async with (
        MemoryStore() as store,
        ReferenceAgent(store, side_effects=tmp_path / "effects") as agent,
        raw_peer(agent) as connected,
    ):
        yield connected


def code(answer: dict[str, Any]) -> int:
    error: dict[str, Any] = answer["error"]
    return int(error["code"])


async def test_before_initialize_notifications_and_responses_are_ignored_and_requests_refused(
    tmp_path: Path,
) -> None:
    async with peer(tmp_path) as p:
        await p.notify("session/cancel", {"sessionId": "s"})
        await p.reply(7, {"stray": True})
        refused = await p.call("session/new", {"cwd": "/w", "mcpServers": []}, id="early")
        assert code(refused) == INVALID_REQUEST and refused["id"] == "early"
        # the notification and the response got no answer: the only frame is the refusal
        assert p.received == [refused]
        answer = await p.call("initialize", V1_INIT)
        assert answer["result"]["protocolVersion"] == 1


async def test_before_initialize_a_batch_is_gated_entry_by_entry_and_v1_then_refuses_batches(
    tmp_path: Path,
) -> None:
    async with peer(tmp_path) as p:
        # the version is not fixed yet: each entry meets the initialize rules on its own (D42)
        init = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": V1_INIT}
        await p.send([init, {**init, "id": 2}])
        reply: Any = await p.wait_for(lambda msg: isinstance(msg, list))
        answers = {answer["id"]: answer for answer in reply}
        assert answers[1]["result"]["protocolVersion"] == 1
        assert code(answers[2]) == INVALID_REQUEST  # initialize already in progress
        assert p.served.version == 1
        p.received.remove(reply)  # the peer's helpers read objects only
        # a v1 connection takes no batches: one -32600 with id null, nothing processed
        await p.send([{"jsonrpc": "2.0", "id": 3, "method": "session/new", "params": {}}])
        refused = await p.wait_for(lambda msg: isinstance(msg, dict) and msg.get("id") is None)
        assert code(refused) == INVALID_REQUEST
        assert refused["error"]["message"] == "Batches are not supported on ACP v1 connections"
        answer = await p.call("session/list", {})
        assert "sessions" in answer["result"]
        assert len(p.received) == 2  # the refusal and the list: nothing else came


async def test_a_failed_initialize_leaves_the_connection_open_for_another(tmp_path: Path) -> None:
    async with peer(tmp_path) as p:
        for params in (None, {"protocolVersion": "1"}, {"protocolVersion": 1.5}, {}):
            assert code(await p.call("initialize", params)) == INVALID_PARAMS
        too_old = await p.call("initialize", {"protocolVersion": 0})
        assert code(too_old) == UNSUPPORTED_PROTOCOL_VERSION
        assert too_old["error"]["data"] == {"requested": 0, "supported": [1, 2]}
        # exactly the selected version is validated strictly: v1's clientInfo, v2's info
        bad_v1 = await p.call("initialize", {"protocolVersion": 1, "clientInfo": 5})
        assert code(bad_v1) == INVALID_PARAMS
        assert code(await p.call("initialize", {"protocolVersion": 2})) == INVALID_PARAMS
        answer = await p.call("initialize", V1_INIT)
        assert answer["result"]["protocolVersion"] == 1
        assert p.served.version == 1


async def test_a_v2_initialize_needs_a_string_or_integer_id(tmp_path: Path) -> None:
    async with peer(tmp_path) as p:
        await p.send({"jsonrpc": "2.0", "id": None, "method": "initialize", "params": V2_INIT})
        refused = await p.wait_for(lambda msg: "error" in msg)
        assert refused["id"] is None and code(refused) == INVALID_REQUEST
        assert p.served.version is None
        assert (await p.call("initialize", V2_INIT, id="init"))["result"]["protocolVersion"] == 2


async def test_a_newer_version_downgrades_to_v2_and_its_unparsable_params_are_dropped(
    tmp_path: Path,
) -> None:
    async with peer(tmp_path) as p:
        newer = {"protocolVersion": 3, "info": 7, "capabilities": "none", "_meta": []}
        answer = await p.call("initialize", newer)
        assert answer["result"]["protocolVersion"] == 2
        assert answer["result"]["info"]["name"] == "acp-once-reference"
        info = p.served.client_info
        assert info is not None and info.info.name == "unknown"
        assert "capabilities" not in info.model_fields_set and info.field_meta is None


async def test_client_info_reads_back_the_v2_initialize_as_validated(tmp_path: Path) -> None:
    """The connection keeps the client's `initialize` (as JSON, validated again when read):
    what it gives back equals the request as validated, unset fields and extras included."""
    params = {
        "protocolVersion": 2,
        "info": {"name": "raw", "title": "Raw", "version": "2"},
        "capabilities": {"elicitation": {}, "_meta": {"x": [1, "two", None]}},
        "_meta": {"trace": "t-1"},
        "vendorExtra": {"kept": True},
    }
    async with peer(tmp_path) as p:
        before = p.served.client_info
        assert before is None
        assert (await p.call("initialize", params))["result"]["protocolVersion"] == 2
        info = p.served.client_info
        expected = s.InitializeRequest.model_validate(params)
        assert info == expected
        assert info is not None and info.model_fields_set == expected.model_fields_set
        assert info.model_dump(by_alias=True, exclude_unset=True) == params
        assert p.served.client_info is info  # validated once, then kept


async def test_a_v2_connection_takes_repeats_for_v2_or_newer_and_refuses_v1(
    tmp_path: Path,
) -> None:
    async with peer(tmp_path) as p:
        assert (await p.call("initialize", V2_INIT))["result"]["protocolVersion"] == 2
        newer = await p.call("initialize", {**V2_INIT, "protocolVersion": 9})
        assert newer["result"]["protocolVersion"] == 2
        assert code(await p.call("initialize", V1_INIT)) == INVALID_REQUEST
        assert p.served.version == 2 and p.served.v1_face is None
        await p.call("session/new", {"cwd": "/w"})
        # after another request, no initialize at all
        assert code(await p.call("initialize", V2_INIT)) == INVALID_REQUEST


async def test_a_v1_connection_stays_v1_whatever_a_repeat_asks_for(tmp_path: Path) -> None:
    async with peer(tmp_path) as p:
        first = await p.call("initialize", V1_INIT)
        again = await p.call("initialize", {**V2_INIT, "protocolVersion": 2})
        assert first["result"]["protocolVersion"] == again["result"]["protocolVersion"] == 1
        assert p.served.version == 1
        created = await p.call("session/new", {"cwd": "/w", "mcpServers": []})
        assert created["result"]["sessionId"].startswith("sess")
        assert code(await p.call("initialize", V1_INIT)) == INVALID_REQUEST


async def test_the_v1_initialize_result_is_v1s_and_carries_no_key_marker(tmp_path: Path) -> None:
    async with peer(tmp_path) as p:
        result = (await p.call("initialize", V1_INIT))["result"]
    parsed = v1.InitializeResponse.model_validate(result)
    assert parsed.protocol_version == 1
    assert parsed.agent_info is not None and parsed.agent_info.name == "acp-once-reference"
    capabilities = result["agentCapabilities"]
    assert capabilities["loadSession"] is True
    assert capabilities["promptCapabilities"] == {
        "image": True,
        "audio": True,
        "embeddedContext": True,
    }
    assert set(capabilities["sessionCapabilities"]) == {"list", "delete", "resume", "close"}
    assert "_meta" not in result and "info" not in result


def test_route_initialize_selects_and_normalizes() -> None:
    assert route_initialize({"protocolVersion": 2, "info": {"x": 1}}, None) == (
        2,
        {"protocolVersion": 2, "info": {"x": 1}},  # exactly 2: left for strict validation
    )
    selected, params = route_initialize({"protocolVersion": 70, "info": None}, None)
    assert selected == 2 and params == {"protocolVersion": 2, "info": UNKNOWN_IMPLEMENTATION}
    selected, params = route_initialize({"protocolVersion": 1}, None)
    assert selected == 1 and params["protocolVersion"] == 1 and "clientInfo" not in params
    # a repeat on a v1 connection asking for v2: v1, the client's info kept as clientInfo
    info = {"name": "n", "version": "v"}
    selected, params = route_initialize({"protocolVersion": 2, "info": info}, 1)
    assert selected == 1 and params["protocolVersion"] == 1 and params["clientInfo"] == info
    with pytest.raises(InvalidRequest):
        route_initialize({"protocolVersion": 1}, 2)
    with pytest.raises(UnsupportedProtocolVersion):
        route_initialize({"protocolVersion": 0}, None)
    bad_params: list[object] = [{"protocolVersion": True}, {"protocolVersion": 65536}, [], "x"]
    for bad in bad_params:
        with pytest.raises(InvalidParams):
            route_initialize(bad, None)
