"""The v1 face in process: a `SessionAgent` written once (v2 `run_turn`, `TurnContext.emit`)
served to a raw v1 client over memory streams, and to a v2 client on the same session."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import orjson
import pytest

from acp_once.agent import StopReason
from acp_once.agent.runtime import HeldPolicy, SessionAgent, Turn, TurnContext
from acp_once.agent.updates import selected_option
from acp_once.protocol import schema as s
from acp_once.protocol import v1
from acp_once.protocol.errors import INTERNAL_ERROR, METHOD_NOT_FOUND, RESOURCE_NOT_FOUND
from acp_once.storage import MemoryStore
from acp_once.testing import connected
from tests.agent.v1_peer import TIMEOUT, V1_INIT, RawPeer, raw_peer
from tests.helpers import UpdateRecorder, initialize_request

pytestmark = pytest.mark.anyio

KEY = "v1-key-that-must-stay-unused"


class Scripted(SessionAgent):
    """Its turn: "[hold]" streams "working" and waits for `release` (or a cancel);
    "[permission]" asks first and reports the option chosen; "[fail]" raises; "[max]" stops
    with `max_tokens`. Every turn ends with the prompt's text as a retained agent message."""

    def __init__(self, store: MemoryStore, policy: HeldPolicy = "hold") -> None:
        super().__init__(store, name="scripted", policy=policy)
        self.release = anyio.Event()

    async def run_turn(self, turn: Turn, emit: TurnContext) -> StopReason:
        text = turn.text
        if "[permission]" in text:
            answer = await emit.request_permission(title="Write the file?", tool_call_id="c1")
            await emit.emit(_message(f"chose {selected_option(answer)}"))
        if "[hold]" in text:
            await emit.emit({**_message("working"), "sessionUpdate": "agent_message_chunk"})
            await self.release.wait()
        if "[fail]" in text:
            raise RuntimeError("boom")
        await emit.emit(_message(text), retain=True)
        return "max_tokens" if "[max]" in text else "end_turn"


def _message(text: str) -> dict[str, Any]:
    content: list[Any] = [{"type": "text", "text": text}]
    if not text.startswith("working"):
        return {"sessionUpdate": "agent_message", "messageId": f"a-{text}", "content": content}
    return {"sessionUpdate": "agent_message", "messageId": "a-working", "content": content[0]}


@asynccontextmanager
async def scripted(policy: HeldPolicy = "hold") -> AsyncIterator[Scripted]:
    async with MemoryStore() as store, Scripted(store, policy) as agent:
        yield agent


@asynccontextmanager
async def v1_client(agent: SessionAgent) -> AsyncIterator[RawPeer]:
    async with raw_peer(agent) as peer:
        assert (await peer.call("initialize", V1_INIT))["result"]["protocolVersion"] == 1
        yield peer


async def new_session(peer: RawPeer) -> str:
    answer = await peer.call("session/new", {"cwd": "/w", "mcpServers": []})
    session_id: str = answer["result"]["sessionId"]
    return session_id


def prompt_params(session_id: str, text: str, **extra: Any) -> dict[str, Any]:
    return {"sessionId": session_id, "prompt": [{"type": "text", "text": text}], **extra}


def texts(updates: list[dict[str, Any]], kind: str) -> list[str]:
    return [u["content"]["text"] for u in updates if u["sessionUpdate"] == kind]


def assert_v1(peer: RawPeer) -> None:
    for msg in peer.received:
        if msg.get("method") == "session/update":
            v1.SessionNotification.model_validate(msg["params"])


async def test_a_v1_prompt_is_answered_when_its_turn_ends() -> None:
    async with scripted() as agent, v1_client(agent) as peer:
        sid = await new_session(peer)
        await peer.send(
            {
                "jsonrpc": "2.0",
                "id": "p1",
                "method": "session/prompt",
                "params": prompt_params(sid, "[hold] one"),
            }
        )
        await peer.wait_for(lambda m: m.get("method") == "session/update")
        assert not [m for m in peer.received if m.get("id") == "p1"]  # the turn still runs
        agent.release.set()
        answer = await peer.answer("p1")
        assert answer["result"] == {"stopReason": "end_turn"}
        updates = peer.updates(sid)
        # the client's own prompt is not echoed; state updates have no v1 form
        assert [u["sessionUpdate"] for u in updates] == ["agent_message_chunk"] * 2
        assert texts(updates, "agent_message_chunk") == ["working", "[hold] one"]
        assert_v1(peer)
        # the next prompt's turn is followed as well
        assert (await peer.call("session/prompt", prompt_params(sid, "two")))["result"] == {
            "stopReason": "end_turn"
        }


async def test_stop_reasons_and_failed_turns() -> None:
    async with scripted() as agent, v1_client(agent) as peer:
        sid = await new_session(peer)
        maxed = await peer.call("session/prompt", prompt_params(sid, "[max]"))
        assert maxed["result"] == {"stopReason": "max_tokens"}
        failed = await peer.call("session/prompt", prompt_params(sid, "[fail]"))
        assert failed["error"]["code"] == INTERNAL_ERROR
        assert "RuntimeError" in failed["error"]["message"]
        assert (await peer.call("session/prompt", prompt_params(sid, "ok")))["result"] == {
            "stopReason": "end_turn"
        }


async def test_an_idempotency_key_on_a_v1_prompt_is_an_unknown_field() -> None:
    async with scripted() as agent, v1_client(agent) as peer:
        sid = await new_session(peer)
        for _ in range(2):
            answer = await peer.call(
                "session/prompt", prompt_params(sid, "same", idempotencyKey=KEY)
            )
            assert answer["result"] == {"stopReason": "end_turn"}
        # v1 has no keys: two prompts, two user messages, the key recorded nowhere
        timeline = await agent.store.read_timeline(sid, after_seq=0, limit=100)
        kinds = [orjson.loads(entry.update)["sessionUpdate"] for entry in timeline]
        assert kinds.count("user_message") == 2
        assert await agent.store.find_key(sid, KEY) is None
        assert KEY not in orjson.dumps(peer.received).decode()


async def test_session_cancel_answers_the_waiting_prompt_cancelled() -> None:
    async with scripted() as agent, v1_client(agent) as peer:
        sid = await new_session(peer)
        await peer.send(
            {
                "jsonrpc": "2.0",
                "id": "p",
                "method": "session/prompt",
                "params": prompt_params(sid, "[hold]"),
            }
        )
        await peer.wait_for(lambda m: m.get("method") == "session/update")
        await peer.notify("session/cancel", {"sessionId": sid})
        assert (await peer.answer("p"))["result"] == {"stopReason": "cancelled"}


async def test_a_permission_request_goes_out_in_v1s_shape_and_its_answer_comes_back() -> None:
    async with scripted() as agent, v1_client(agent) as peer:
        sid = await new_session(peer)
        await peer.send(
            {
                "jsonrpc": "2.0",
                "id": "p",
                "method": "session/prompt",
                "params": prompt_params(sid, "[permission]"),
            }
        )
        asked = await peer.wait_for(lambda m: m.get("method") == "session/request_permission")
        request = v1.RequestPermissionRequest.model_validate(asked["params"])
        assert request.tool_call.tool_call_id == "c1"
        assert request.tool_call.title == "Write the file?"
        assert [o.option_id for o in request.options] == ["allow_once", "reject_once"]
        await peer.reply(
            asked["id"], {"outcome": {"outcome": "selected", "optionId": "allow_once"}}
        )
        assert (await peer.answer("p"))["result"] == {"stopReason": "end_turn"}
        assert "chose allow_once" in texts(peer.updates(sid), "agent_message_chunk")


async def test_session_load_replays_the_history_as_v1_updates_then_answers() -> None:
    async with scripted() as agent:
        async with v1_client(agent) as first:
            sid = await new_session(first)
            await first.call("session/prompt", prompt_params(sid, "remember me"))
        async with v1_client(agent) as second:
            load = {"sessionId": sid, "cwd": "/w", "mcpServers": []}
            answer = await second.call("session/load", load)
            assert answer["result"] == {}
            v1.LoadSessionResponse.model_validate(answer["result"])
            replayed = second.updates(sid)
            assert texts(replayed, "user_message_chunk") == ["remember me"]
            assert texts(replayed, "agent_message_chunk") == ["remember me"]
            # the updates came before the answer
            assert second.received.index(answer) == len(second.received) - 1
            assert_v1(second)
            again = await second.call("session/prompt", prompt_params(sid, "again"))
            assert again["result"] == {"stopReason": "end_turn"}


async def test_a_v1_and_a_v2_client_share_one_session() -> None:
    async with scripted() as agent, v1_client(agent) as old:
        sid = await new_session(old)
        await old.call("session/prompt", prompt_params(sid, "from v1"))
        recorder = UpdateRecorder()
        async with connected(agent, recorder) as new:
            await new.agent.initialize(initialize_request("v2"))
            await new.agent.resume_session(
                s.ResumeSessionRequest.model_validate(
                    {"sessionId": sid, "cwd": "/w", "replayFrom": {"type": "start"}}
                )
            )
            replay = recorder.updates
            assert [
                u["content"][0]["text"] for u in replay if u["sessionUpdate"] == "user_message"
            ] == ["from v1"]
            accepted = await new.agent.prompt(
                s.PromptRequest.model_validate(
                    {
                        "sessionId": sid,
                        "prompt": [{"type": "text", "text": "from v2"}],
                        "idempotencyKey": KEY,
                    }
                )
            )
            assert accepted.message_id.startswith("msg")
            # the v1 client sees the v2 client's message (not its own: shown) and the reply
            with anyio.fail_after(TIMEOUT):
                await old.wait_for(
                    lambda m: (
                        m.get("method") == "session/update"
                        and m["params"]["update"].get("content", {}).get("text") == "from v2"
                        and m["params"]["update"]["sessionUpdate"] == "agent_message_chunk"
                    )
                )
            assert "from v2" in texts(old.updates(sid), "user_message_chunk")
            assert KEY not in orjson.dumps(old.received).decode()
            await recorder.wait_for(
                lambda updates: any(
                    u.get("state") == "idle" and "stopReason" in u for u in updates[len(replay) :]
                )
            )
        # and the v1 client goes on in the same session
        assert (await old.call("session/prompt", prompt_params(sid, "v1 again")))["result"] == {
            "stopReason": "end_turn"
        }
        timeline = await agent.store.read_timeline(sid, after_seq=0, limit=100)
        users = [
            orjson.loads(entry.update)["content"][0]["text"]
            for entry in timeline
            if orjson.loads(entry.update)["sessionUpdate"] == "user_message"
        ]
        assert users == ["from v1", "from v2", "v1 again"]


def send_prompt(peer: RawPeer, id: str, session_id: str, text: str) -> Any:
    params = prompt_params(session_id, text)
    return peer.send({"jsonrpc": "2.0", "id": id, "method": "session/prompt", "params": params})


@pytest.mark.parametrize("policy", ["hold", "steer"])
async def test_a_prompt_sent_during_a_turn_is_answered_at_the_end_of_its_own(
    policy: HeldPolicy,
) -> None:
    async with scripted(policy) as agent, v1_client(agent) as peer:
        sid = await new_session(peer)
        await send_prompt(peer, "first", sid, "[hold] first")
        await peer.wait_for(lambda m: m.get("method") == "session/update")
        await send_prompt(peer, "second", sid, "second")
        if policy == "steer":  # inserted at once: its turn waits for the running one
            await anyio.wait_all_tasks_blocked()
        agent.release.set()
        first, second = await peer.answer("first"), await peer.answer("second")
        assert first["result"] == second["result"] == {"stopReason": "end_turn"}
        assert peer.received.index(first) < peer.received.index(second)
        assert texts(peer.updates(sid), "agent_message_chunk") == [
            "working",
            "[hold] first",
            "second",
        ]


@pytest.mark.parametrize("policy", ["hold", "steer"])
async def test_session_cancel_answers_every_waiting_prompt_cancelled(policy: HeldPolicy) -> None:
    async with scripted(policy) as agent, v1_client(agent) as peer:
        sid = await new_session(peer)
        await send_prompt(peer, "first", sid, "[hold] first")
        await peer.wait_for(lambda m: m.get("method") == "session/update")
        await send_prompt(peer, "second", sid, "second")
        await anyio.wait_all_tasks_blocked()  # held (hold) or queued behind the turn (steer)
        await peer.notify("session/cancel", {"sessionId": sid})
        for id in ("first", "second"):
            assert (await peer.answer(id))["result"] == {"stopReason": "cancelled"}
        # the second turn never ran
        assert texts(peer.updates(sid), "agent_message_chunk") == ["working"]
        after = await peer.call("session/prompt", prompt_params(sid, "after"))
        assert after["result"] == {"stopReason": "end_turn"}


async def test_the_other_v1_session_methods_map_to_the_v2_ones() -> None:
    async with scripted() as agent:
        async with v1_client(agent) as first:
            sid = await new_session(first)
        async with v1_client(agent) as peer:
            listed = (await peer.call("session/list", {}))["result"]
            v1.ListSessionsResponse.model_validate(listed)
            assert [info["sessionId"] for info in listed["sessions"]] == [sid]
            # resume: active again, no history replayed
            assert (await peer.call("session/resume", {"sessionId": sid, "cwd": "/w"}))[
                "result"
            ] == {}
            assert peer.updates(sid) == []
            done = await peer.call("session/prompt", prompt_params(sid, "resumed"))
            assert done["result"] == {"stopReason": "end_turn"}
            assert (await peer.call("session/close", {"sessionId": sid}))["result"] == {}
            closed = await peer.call("session/prompt", prompt_params(sid, "closed"))
            assert closed["error"]["code"] == RESOURCE_NOT_FOUND
            mode = await peer.call("session/set_mode", {"sessionId": sid, "modeId": "x"})
            assert mode["error"]["code"] == METHOD_NOT_FOUND
            assert (await peer.call("session/delete", {"sessionId": sid}))["result"] == {}
            assert (await peer.call("session/list", {}))["result"]["sessions"] == []


async def test_lone_surrogates_on_the_v1_face_are_invalid_params(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A v1 prompt text holding a lone surrogate is invalid params (-32602, as on the v2 face),
    and a lone surrogate as the id of a `session/list` whose answer holds a time gets its answer:
    never -32603 with a traceback, and nothing stored."""
    async with scripted() as agent, v1_client(agent) as peer:
        sid = await new_session(peer)
        await peer.send_raw(
            b'{"jsonrpc":"2.0","id":7,"method":"session/prompt","params":{"sessionId":"'
            + sid.encode()
            + b'","prompt":[{"type":"text","text":"\\ud800"}]}}'
        )
        assert (await peer.answer(7))["error"]["code"] == -32602
        # a lone surrogate is valid JSON: the id is answered as it came, escaped
        await peer.send_raw(b'{"jsonrpc":"2.0","id":"\\ud800","method":"session/list"}')
        listed = await peer.answer("\ud800")
        assert [x["sessionId"] for x in listed["result"]["sessions"]] == [sid]
        assert await agent.store.count_user_messages(sid) == 0
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL") or r.exc_info]
