"""The checks: one requirement each, with a stable id tied to rules in docs/rules.md.

A check function drives the target through a `CheckContext` and returns nothing (passed), or a
note to report with the pass (e.g. which of two allowed answers it saw); it raises
`CheckFailed` or `CheckSkipped`. Inserted messages are counted from the wire only (live
`user_message` updates and a resume replay), never from any store.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from acp_once.conformance.harness import (
    NO_KEY,
    CheckContext,
    CheckFailed,
    CheckSkipped,
    Probe,
    error_code,
    expect,
    short,
)
from acp_once.conformance.model import Level
from acp_once.protocol.errors import (
    INVALID_PARAMS,
    INVALID_REQUEST,
    REQUEST_CANCELLED,
    RESOURCE_NOT_FOUND,
    AcpError,
)

__all__ = ["CHECKS", "Check"]

CheckFn = Callable[[CheckContext], Awaitable[str | None]]


@dataclass(frozen=True, slots=True)
class Check:
    id: str
    level: Level
    refs: tuple[str, ...]
    title: str
    run: CheckFn


CHECKS: list[Check] = []


def check(id: str, level: Level, refs: tuple[str, ...], title: str) -> Callable[[CheckFn], CheckFn]:
    def register(fn: CheckFn) -> CheckFn:
        CHECKS.append(Check(id, level, refs, title, fn))
        return fn

    return register


INFO = {"name": "acp-once-check", "version": "1"}


async def _code_of(probe: Probe, method: str, params: Any) -> int | None:
    """None when the request succeeded, else the error code."""
    try:
        await probe.request(method, params)
    except AcpError as exc:
        return exc.code
    return None


def _new(ids: set[str], *old: str) -> set[str]:
    return ids - set(old)


# -- initialize and sessions -------------------------------------------------------------------


@check("init.version", Level.MUST, ("D23", "R49"), "initialize negotiates version 2")
async def _init_version(ctx: CheckContext) -> str | None:
    async with ctx.connect(initialize=False) as p:
        first = await p.request("initialize", {"protocolVersion": 2, "info": INFO})
        expect(
            isinstance(first, dict) and first.get("protocolVersion") == 2,
            f"initialize with protocolVersion 2 answered {first!r}",
        )
        caps = first.get("capabilities") or {}
        expect(
            isinstance(caps.get("session"), dict),
            "capabilities.session is not advertised, so nothing else can be checked (R1)",
        )
        if not ctx.target.repeat_initialize:
            # Streamable HTTP: every initialize opens a new connection (2.4), so the repeat
            # rules have nothing to apply to
            return "the repeat-initialize rules do not apply over Streamable HTTP"
        again = await p.request("initialize", {"protocolVersion": 7, "info": INFO})
        version = again.get("protocolVersion") if isinstance(again, dict) else None
        expect(
            isinstance(version, int) and 2 <= version <= 7,
            f"a repeated initialize asking for 7 must get the highest supported version <= 7; "
            f"got {version!r} (D23)",
        )
        # any other request will do; session/new is one every agent checked here must have
        await p.request("session/new", {"cwd": ctx.cwd})
        code = await _code_of(p, "initialize", {"protocolVersion": 2, "info": INFO})
        expect(
            code == INVALID_REQUEST,
            f"initialize after another request must be refused with -32600; got {code} (2.4)",
        )
    return None


@check("session.new", Level.MUST, ("R63", "R50"), "session/new, then a prompt is echoed")
async def _session_new(ctx: CheckContext) -> str | None:
    async with ctx.connect() as p:
        a, b = await p.new_session(), await p.new_session()
        expect(a != b, f"two session/new calls gave the same sessionId {a!r}")
        mid = await p.prompt(a, "hello")
        await p.wait_for(
            lambda: mid in p.user_message_updates(a),
            f"a user_message update with messageId {mid} (the prompt's message, inserted)",
        )
    return None


@check(
    "resume.state-before-response",
    Level.MUST,
    ("R60",),
    "session/resume sends replay, then a state_update, before its response",
)
async def _resume_state(ctx: CheckContext) -> str | None:
    async with ctx.connect() as p:
        sid = await p.new_session()
        mid = await p.prompt(sid, "remember me")
    async with ctx.connect() as p:
        for replay in (False, True):
            mark = len(p.tap.frames)
            call = await p.resume(sid, replay=replay)
            frames = p.tap.frames[mark:]
            answers = [
                i for i, f in enumerate(frames) if "method" not in f and f.get("id") == call.id
            ]
            expect(bool(answers), "the resume response was not a JSON object")
            answer = answers[0]
            before = [
                (f.get("params") or {}).get("update") or {}
                for f in frames[:answer]
                if f.get("method") == "session/update"
                and (f.get("params") or {}).get("sessionId") == sid
            ]
            kinds = [u.get("sessionUpdate") for u in before]
            label = "with replay" if replay else "without replay"
            expect(
                "state_update" in kinds,
                f"no state_update for the session before the resume response ({label})",
            )
            if replay:
                replayed = [
                    u.get("messageId")
                    for u in before
                    if u.get("sessionUpdate") in ("user_message", "user_message_chunk")
                ]
                expect(mid in replayed, "the replay did not contain the inserted user message")
                last_user = max(i for i, u in enumerate(before) if u.get("messageId") == mid)
                expect(
                    "state_update" in kinds[last_user + 1 :],
                    "the state_update must follow the replayed history",
                )
            else:
                expect(
                    not any(k in ("user_message", "user_message_chunk") for k in kinds),
                    "history was replayed although replayFrom was omitted",
                )
    return None


@check(
    "close.idempotent",
    Level.SHOULD,
    ("R61", "D24", "R58"),
    "session/close succeeds again and for unknown sessions; a closed session is not active",
)
async def _close(ctx: CheckContext) -> str | None:
    async with ctx.connect() as p:
        sid = await p.new_session()
        await p.request("session/close", {"sessionId": sid})
        code = await _code_of(p, "session/prompt", p.prompt_params(sid, "after close"))
        expect(
            code == RESOURCE_NOT_FOUND,
            f"a prompt on a closed session must get -32002; got {code or 'success'} (6.3)",
        )
        for which, target in (("again", sid), ("for an unknown session", "sess_acp_once_none")):
            code = await _code_of(p, "session/close", {"sessionId": target})
            expect(code is None, f"session/close {which} answered {code} instead of success")
    return None


@check(
    "delete.idempotent",
    Level.SHOULD,
    ("R62", "D24"),
    "session/delete succeeds again and for unknown sessions; the session leaves session/list",
)
async def _delete(ctx: CheckContext) -> str | None:
    async with ctx.connect() as p:
        if not ctx.session_capability("delete"):
            raise CheckSkipped("the agent does not advertise capabilities.session.delete")
        sid = await p.new_session()
        await p.prompt(sid, "to be deleted")
        for which, target in (
            ("the first time", sid),
            ("again", sid),
            ("for an unknown session", "sess_acp_once_none"),
        ):
            code = await _code_of(p, "session/delete", {"sessionId": target})
            expect(code is None, f"session/delete {which} answered {code} instead of success")
        listed = await p.request("session/list", {"cwd": ctx.cwd})
        ids = [x.get("sessionId") for x in (listed or {}).get("sessions", [])]
        expect(sid not in ids, "a deleted session is still in session/list")
    return None


@check(
    "cancel-request.exactly-once",
    Level.MUST,
    ("R47", "R48"),
    "$/cancel_request: exactly one response per request, none for unknown ids",
)
async def _cancel_request(ctx: CheckContext) -> str | None:
    async with ctx.connect() as p:
        sid = await p.new_session()
        done = await p.start_prompt(sid, "answered first")
        await p.result(done)
        await p.notify("$/cancel_request", {"requestId": done.id})  # already answered: ignore
        await p.notify("$/cancel_request", {"requestId": "acp-once-unknown-request"})
        await p.prompt(sid, ctx.slow_prompt)
        held = await p.start_prompt(sid, "cancel me", ctx.key())
        await held.cancel()
        outcome = await error_code(p, held)
        expect(
            isinstance(outcome, str) or outcome == REQUEST_CANCELLED,
            f"a cancelled prompt must succeed or get -32800; got {outcome}",
        )
        await p.request("session/list", {})  # a barrier: anything stray has arrived by now
        answers: dict[Any, int] = {}
        for frame in p.tap.frames:
            if "method" not in frame and "id" in frame:
                answers[frame["id"]] = answers.get(frame["id"], 0) + 1
        twice = [i for i, n in answers.items() if n > 1]
        expect(not twice, f"more than one response for request id(s) {twice}")
        expect(
            "acp-once-unknown-request" not in answers and None not in answers,
            "a response was sent for a $/cancel_request notification",
        )
    return None


# -- key validation ---------------------------------------------------------------------------


@check("key.valid", Level.MUST, ("R5",), "keys of 1 and 255 characters are accepted")
async def _key_valid(ctx: CheckContext) -> str | None:
    async with ctx.connect() as p:
        sid = await p.new_session()
        one = await p.prompt(sid, "one-character key", "x")
        long_key = ctx.key()
        long_key += "k" * (255 - len(long_key))
        long = await p.prompt(sid, "255-character key", long_key)
        expect(one != long, "two different keys got the same messageId")
        again = await p.prompt(sid, "255-character key", long_key)
        expect(again == long, "a retry with a 255-character key inserted a new message")
    return None


@check(
    "key.null-absent",
    Level.MUST,
    ("R4",),
    "prompts with no key or a null key are each inserted, with distinct ids",
)
async def _key_null(ctx: CheckContext) -> str | None:
    async with ctx.connect() as p:
        sid = await p.new_session()
        ids = [await p.prompt(sid, "same text", key) for key in (NO_KEY, NO_KEY, None, None)]
        expect(len(set(ids)) == 4, f"4 unkeyed prompts got only {len(set(ids))} distinct ids")
        inserted = await p.inserted(sid)
        expect(set(ids) <= inserted, "an answered unkeyed prompt was never seen as inserted")
    return None


_INVALID: dict[str, Any] = {
    "empty": "",
    "too-long": None,  # 256 characters, made per run
    "number": 123,
    "boolean": True,
    "object": {},
    "array": [],
}


def _invalid_check(kind: str) -> CheckFn:
    async def run(ctx: CheckContext) -> str | None:
        bad = _INVALID[kind]
        if kind == "too-long":
            bad = ctx.key()
            bad += "k" * (256 - len(bad))
        async with ctx.connect() as p:
            sid = await p.new_session()
            try:
                result = await p.request("session/prompt", p.prompt_params(sid, "bad key", bad))
            except AcpError as exc:
                expect(exc.code == INVALID_PARAMS, f"answered {exc.code}, not -32602 (R5)")
            else:
                raise CheckFailed(f"the prompt was accepted: {result!r} (R5, R6)")
            inserted = await p.inserted(sid)
            expect(not inserted, f"a refused prompt was inserted anyway: {sorted(inserted)} (R6)")
        return None

    return run


for _kind in _INVALID:
    check(
        f"key.invalid.{_kind}",
        Level.MUST,
        ("R5", "R6"),
        f"an invalid key ({_kind}) gets -32602, nothing inserted, no user_message",
    )(_invalid_check(_kind))


@check("key.case-sensitive", Level.MUST, ("R7",), "keys differing only in case are distinct")
async def _key_case(ctx: CheckContext) -> str | None:
    upper = ctx.key("Case")
    lower = "c" + upper[1:]
    ctx.suite.keys.add(lower)
    async with ctx.connect() as p:
        sid = await p.new_session()
        a = await p.prompt(sid, "same text", upper)
        b = await p.prompt(sid, "same text", lower)
        expect(a != b, "keys differing only in case were treated as the same key")
        expect({a, b} <= await p.inserted(sid), "both prompts must be inserted")
    return None


# -- the RFD's traces (T1-T7, docs/protocol/keys.md) -------------------------------------------


@check(
    "trace.T1-same-connection",
    Level.MUST,
    ("R19", "R21", "D8"),
    "a retry on the same connection gets the original messageId and inserts nothing",
)
async def _t1(ctx: CheckContext) -> str | None:
    key = ctx.key()
    async with ctx.connect() as p:
        sid = await p.new_session()
        first = await p.prompt(sid, "T1 prompt", key)
        second = await p.prompt(sid, "T1 prompt", key)
        expect(first == second, f"the retry got {second}, not the original {first} (R19)")
        inserted = await p.inserted(sid)
        expect(inserted == {first}, f"expected one inserted message, saw {sorted(inserted)}")
    return None


@check(
    "trace.T2-new-connection",
    Level.MUST,
    ("R33", "R35", "D17"),
    "after a new connection and session/resume, a retry gets the original messageId",
)
async def _t2(ctx: CheckContext) -> str | None:
    key = ctx.key()
    note = None
    async with ctx.connect() as p:
        sid = await p.new_session()
        first = await p.prompt(sid, "T2 prompt", key)
    # the connection ended (stdio: the agent process exited); a new one, same storage
    async with ctx.connect() as p:
        try:
            early = await p.prompt(sid, "T2 prompt", key)
        except AcpError as exc:
            if exc.code != RESOURCE_NOT_FOUND:
                note = f"a retry before session/resume got {exc.code}, not -32002 (D17)"
        else:
            expect(early == first, f"a retry before resume inserted a new message {early}")
            note = "a retry before session/resume was answered (expected -32002, D17)"
        await p.resume(sid)
        again = await p.prompt(sid, "T2 prompt", key)
        expect(again == first, f"the retry got {again}, not the original {first} (R33)")
        inserted = await p.inserted(sid)
        expect(inserted == {first}, f"expected one inserted message, saw {sorted(inserted)}")
    return note


@check(
    "trace.T3-agent-restart",
    Level.MUST,
    ("R35", "R38", "R39"),
    "after the agent is killed (SIGKILL) and restarted, a retry gets the original messageId",
)
async def _t3(ctx: CheckContext) -> str | None:
    if ctx.target.no_restart is not None:
        raise CheckSkipped(ctx.target.no_restart)
    key = ctx.key()
    async with ctx.connect() as p:
        sid = await p.new_session()
        first = await p.prompt(sid, "T3 prompt", key)
        await p.kill()
    async with ctx.connect() as p:
        await p.resume(sid)
        again = await p.prompt(sid, "T3 prompt", key)
        expect(again == first, f"the retry got {again}, not the original {first} (R35)")
        inserted = await p.inserted(sid)
        expect(inserted == {first}, f"expected one inserted message, saw {sorted(inserted)}")
    return None


@check(
    "trace.T4-retry-while-held",
    Level.MUST,
    ("R20", "R24"),
    "a retry while the prompt is held is answered with the same outcome; one insertion",
)
async def _t4(ctx: CheckContext) -> str | None:
    key = ctx.key()
    async with ctx.connect() as p:
        sid = await p.new_session()
        busy = await p.prompt(sid, ctx.slow_prompt)
        first = await p.start_prompt(sid, "T4 prompt", key)
        retry = await p.start_prompt(sid, "T4 prompt", key)
        a, b = await error_code(p, first), await error_code(p, retry)
        expect(isinstance(a, str), f"the held prompt was not inserted: {a}")
        expect(a == b, f"the original got {a}, the retry {b} (R20: same outcome)")
        inserted = _new(await p.inserted(sid), busy)
        expect(inserted == {a}, f"expected one inserted message, saw {sorted(inserted)}")
    return None


@check(
    "trace.T5-retry-after-error",
    Level.MUST,
    ("R22", "R28", "D33"),
    "after a held prompt is refused (session/cancel, -32800), the retry inserts it once",
)
async def _t5(ctx: CheckContext) -> str | None:
    key = ctx.key()
    async with ctx.connect() as p:
        sid = await p.new_session()
        busy = await p.prompt(sid, ctx.slow_prompt)
        held = await p.start_prompt(sid, "T5 prompt", key)
        await p.notify("session/cancel", {"sessionId": sid})
        outcome = await error_code(p, held)
        if isinstance(outcome, str):
            raise CheckSkipped(
                "the prompt was inserted during active work, so session/cancel could not "
                "refuse it; no error to retry after"
            )
        expect(outcome == REQUEST_CANCELLED, f"session/cancel answered the held prompt {outcome}")
        first = await p.prompt(sid, "T5 prompt", key)
        second = await p.prompt(sid, "T5 prompt", key)
        expect(first == second, f"two retries got {first} and {second}")
        inserted = _new(await p.inserted(sid), busy)
        expect(
            inserted == {first},
            f"the retry after the error answered {first} but the inserted messages are "
            f"{sorted(inserted)}: an error must leave the key unused (R22)",
        )
    return None


@check(
    "trace.T6-other-session",
    Level.MUST,
    ("R32", "D15"),
    "the same key in another session (and in a fork) is a new submission",
)
async def _t6(ctx: CheckContext) -> str | None:
    key = ctx.key()
    async with ctx.connect() as p:
        a, b = await p.new_session(), await p.new_session()
        in_a = await p.prompt(a, "T6 prompt", key)
        in_b = await p.prompt(b, "T6 prompt", key)
        expect(in_a != in_b, "the same key in another session returned the first session's id")
        expect(in_b in await p.inserted(b), "the prompt in the second session was not inserted")
        if not ctx.session_capability("fork"):
            return "fork not advertised: checked another session only"
        fork = await p.request("session/fork", {"sessionId": a, "cwd": ctx.cwd})
        fid = fork.get("sessionId") if isinstance(fork, dict) else None
        expect(isinstance(fid, str), f"session/fork answered {fork!r}")
        assert isinstance(fid, str)
        in_fork = await p.prompt(fid, "T6 prompt", key)
        expect(in_fork not in (in_a, in_b), "the same key in a fork returned an existing id")
        expect(in_fork in await p.inserted(fid), "the prompt in the fork was not inserted")
        expect(await p.prompt(a, "T6 prompt", key) == in_a, "the first session lost its key")
    return "checked another session and a fork"


@check(
    "trace.T7-inserted-during-work",
    Level.MUST,
    ("R19", "R21"),
    "a keyed prompt inserted during active work, retried, gets the same messageId",
)
async def _t7(ctx: CheckContext) -> str | None:
    key = ctx.key()
    async with ctx.connect() as p:
        sid = await p.new_session()
        busy = await p.prompt(sid, ctx.slow_prompt)
        first = await p.prompt(sid, "T7 prompt", key)
        again = await p.prompt(sid, "T7 prompt", key)
        expect(again == first, f"the retry got {again}, not the original {first} (R19)")
        inserted = _new(await p.inserted(sid), busy)
        expect(inserted == {first}, f"expected one inserted message, saw {sorted(inserted)}")
    return None


# -- withdrawal, reuse, privacy ----------------------------------------------------------------


@check(
    "withdraw.all-waiters",
    Level.MUST,
    ("R25", "R26", "R22", "D6"),
    "$/cancel_request on a retry withdraws the held prompt: every request gets -32800",
)
async def _withdraw(ctx: CheckContext) -> str | None:
    key = ctx.key()
    async with ctx.connect() as p:
        sid = await p.new_session()
        busy = await p.prompt(sid, ctx.slow_prompt)
        first = await p.start_prompt(sid, "withdrawn prompt", key)
        retry = await p.start_prompt(sid, "withdrawn prompt", key)
        await retry.cancel()
        a, b = await error_code(p, first), await error_code(p, retry)
        if isinstance(a, str) and a == b:
            raise CheckSkipped("the prompt was inserted at once (not held): nothing to withdraw")
        expect(
            a == REQUEST_CANCELLED and b == REQUEST_CANCELLED,
            f"the original got {a}, the cancelled retry {b}; both must get -32800 (R26)",
        )
        again = await p.prompt(sid, "withdrawn prompt", key)
        inserted = _new(await p.inserted(sid), busy)
        expect(
            inserted == {again},
            f"after the withdrawal the next attempt must insert once; saw {sorted(inserted)}",
        )
    return None


@check(
    "reuse.different-prompt",
    Level.MAY,
    ("R23", "D4"),
    "a recorded key with a different prompt: the original id or -32602 (which one is reported)",
)
async def _reuse(ctx: CheckContext) -> str | None:
    key = ctx.key()
    async with ctx.connect() as p:
        sid = await p.new_session()
        original = await p.prompt(sid, "first text", key)
        try:
            other = await p.prompt(sid, "a different text", key)
        except AcpError as exc:
            expect(exc.code == INVALID_PARAMS, f"answered {exc.code}; allowed: id or -32602")
            seen = "refused with -32602 (the agent compares prompts)"
        else:
            expect(
                other == original,
                f"the reused key got a new messageId {other}, not the original {original}: "
                "neither answered as a retry nor refused with -32602",
            )
            seen = "answered as a retry with the original messageId"
        expect(await p.prompt(sid, "first text", key) == original, "the original retry changed")
        inserted = await p.inserted(sid)
        expect(inserted == {original}, f"expected one inserted message, saw {sorted(inserted)}")
    return seen


# -- JSON-RPC batches ---------------------------------------------------------------------------

_BATCHES_NOT_CARRIED = "Streamable HTTP carries no batches (D43): each POST holds one message"
_PING = "acp-once-check/ping"  # a method no agent has: any answer (-32601) will do


def _req(id: str, method: str, params: Any) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": id, "method": method, "params": params}


def _note(method: str) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "method": method, "params": {}}


async def _batch_reply(p: Probe, batch: list[Any], ids: set[Any]) -> list[Any]:
    """Send `batch`; wait for the array answering it (one whose ids meet `ids`) and return it.
    Fails the check if an answer to one of its requests comes alone instead."""
    if not p.ctx.target.carries_batches:
        raise CheckSkipped(_BATCHES_NOT_CARRIED)
    mark = await p.send_raw(batch)

    def replied() -> bool:
        for value in p.arrived_since(mark):
            if isinstance(value, list) and {_id_of(a) for a in value} & ids:
                return True
            expect(
                not (isinstance(value, dict) and value.get("id", "absent") is None),
                f"the batch got one error with id null instead of a reply array: "
                f"{short(repr(value))}; batches are part of ACP v2 (R71, D21)",
            )
            expect(
                not (isinstance(value, dict) and value.get("id") in ids - {None}),
                f"the answer to a batch entry came alone, not in the reply array: "
                f"{short(repr(value))} (R71)",
            )
        return False

    await p.wait_for(replied, "one array answering the batch (R71)")
    return next(
        v for v in p.arrived_since(mark) if isinstance(v, list) and {_id_of(a) for a in v} & ids
    )


def _id_of(answer: Any) -> Any:
    return answer.get("id") if isinstance(answer, dict) else answer


def _wire_code(answer: dict[str, Any]) -> Any:
    error = answer.get("error")
    return error.get("code") if isinstance(error, dict) else None


async def _nothing_before_ping(p: Probe, mark: int, what: str) -> list[Any]:
    """Send a lone request and wait for its answer; return what came since `mark` before it
    (the frames the agent wrote for what was sent earlier)."""
    ping_id = "acp-once-check-ping"
    await p.send_raw(_req(ping_id, _PING, {}))
    answered = lambda: any(  # noqa: E731
        isinstance(v, dict) and v.get("id") == ping_id for v in p.arrived_since(mark)
    )
    await p.wait_for(answered, f"the answer to a lone request sent after {what}")
    before: list[Any] = []
    for value in p.arrived_since(mark):
        if isinstance(value, dict) and value.get("id") == ping_id:
            break
        if not (isinstance(value, dict) and "method" in value):  # the agent's own messages
            before.append(value)
    return before


@check(
    "batch.empty",
    Level.MUST,
    ("R70", "D21"),
    "an empty batch gets one -32600 with id null, not an array",
)
async def _batch_empty(ctx: CheckContext) -> str | None:
    if not ctx.target.carries_batches:
        raise CheckSkipped(_BATCHES_NOT_CARRIED)
    async with ctx.connect() as p:
        mark = await p.send_raw([])
        came = await _nothing_before_ping(p, mark, "an empty batch")
        expect(len(came) == 1, f"an empty batch must get exactly one answer; got {came!r} (R70)")
        [answer] = came
        expect(
            isinstance(answer, dict)
            and answer.get("id", "absent") is None
            and _wire_code(answer) == INVALID_REQUEST,
            f"an empty batch must get one -32600 object with id null; got {short(repr(answer))}",
        )
    return None


@check(
    "batch.mixed",
    Level.MUST,
    ("R71", "R73", "D21"),
    "a batch of requests and a notification gets one array, one answer per request",
)
async def _batch_mixed(ctx: CheckContext) -> str | None:
    async with ctx.connect() as p:
        batch = [
            _req("acp-once-check-b1", "session/new", {"cwd": ctx.cwd}),
            _note("$/acp-once-check"),
            _req("acp-once-check-b2", _PING, {}),
        ]
        ids = {"acp-once-check-b1", "acp-once-check-b2"}
        reply = await _batch_reply(p, batch, ids)
        got = sorted(str(_id_of(a)) for a in reply)
        expect(
            got == sorted(ids),
            f"the reply array must hold one answer per request, none for the notification; "
            f"got ids {got} (R71)",
        )
    return None


@check(
    "batch.notifications-only",
    Level.MUST,
    ("R71", "R48"),
    "a batch of notifications only gets no reply at all",
)
async def _batch_notifications(ctx: CheckContext) -> str | None:
    if not ctx.target.carries_batches:
        raise CheckSkipped(_BATCHES_NOT_CARRIED)
    async with ctx.connect() as p:
        mark = await p.send_raw([_note("$/acp-once-check-1"), _note("$/acp-once-check-2")])
        came = await _nothing_before_ping(p, mark, "a batch of notifications")
        expect(not came, f"a batch of notifications must get no reply; got {came!r} (R71)")
    return None


@check(
    "batch.invalid-entry",
    Level.MUST,
    ("R72",),
    "an invalid entry gets its own -32600 inside the reply array",
)
async def _batch_invalid(ctx: CheckContext) -> str | None:
    async with ctx.connect() as p:
        batch = [17, _req("acp-once-check-b3", _PING, {})]
        reply = await _batch_reply(p, batch, {"acp-once-check-b3"})
        expect(len(reply) == 2, f"two entries, two answers; got {short(repr(reply))} (R72)")
        invalid = [a for a in reply if isinstance(a, dict) and a.get("id", "absent") is None]
        expect(
            len(invalid) == 1 and _wire_code(invalid[0]) == INVALID_REQUEST,
            f"the entry 17 must get -32600 with id null inside the array; got "
            f"{short(repr(reply))} (R72)",
        )
    return None


@check(
    "privacy.no-key-in-frames",
    Level.MUST,
    ("R29", "R31", "D3"),
    "no key used during the suite appears in any frame the agent sent",
)
async def _privacy(ctx: CheckContext) -> str | None:
    key = ctx.key()
    async with ctx.connect() as p:
        sid = await p.new_session()
        await p.prompt(sid, "private", key)
        await p.prompt(sid, "private", key)
        await p.request("session/list", {})
    async with ctx.connect() as p:
        await p.resume(sid, replay=True)
        await p.request("session/list", {})
    keys = sorted(ctx.suite.keys)
    leaks: list[str] = []
    for frame in ctx.suite.received:
        found = [k for k in keys if k.encode() in frame]
        if found:
            leaks.append(frame.decode("utf-8", "replace"))
    if leaks:
        ctx.transcript.extend(
            {"conn": 0, "dir": "received", "t": 0.0, "frame": f} for f in leaks[:50]
        )
        raise CheckFailed(
            f"{len(leaks)} frame(s) from the agent contain an idempotency key; the first: "
            f"{short(leaks[0])}"
        )
    return f"scanned {len(ctx.suite.received)} frames for {len(keys)} keys"
