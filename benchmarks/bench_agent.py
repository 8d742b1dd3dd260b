"""The reference agent over real stdio: prompt throughput, the key's cost, retry latency, and a
side-by-side with an agent on the official TypeScript SDK (2.4.0, its v2 API).

    python3 dev.py run python benchmarks/bench_agent.py [N] [--rounds R] [--retries M]
                [--big SIZE] [--no-ts] [--only throughput,retry,ts] [--profile FILE]

1. Prompts per second, reference agent (`python -m acp_once agent`) with `--store memory:` and
   with `--store sqlite:<tmp file>`, each prompt keyed (a fresh uuid4 key) or unkeyed:
   - sequential prompts: each `session/prompt` awaits its `{messageId}` before the next is sent
     (a prompt that arrives during the previous turn is held, so this is close to the turn
     rate);
   - echo turns: after the answer, wait for that prompt's idle `state_update` (user_message,
     state_update running, agent_message, state_update idle) before sending the next.
   Reports the key's overhead (target < 5%) and SQLite/memory (0.7-0.8 accepted on these
   sequential turns: one durable commit per prompt; issue 23 moved the durable store's target
   to concurrent sessions, `bench_load*.py`), plus the CPU time that the agent process and this
   client spend per turn (from /proc).
   1b. The echo turns again, memory against SQLite, driven by the raw client (below), which
   shows the stores' own cost instead of diluting it in the typed client's.
   1c. The key's cost turn by turn: in one agent process per store, a keyed turn and an
   unkeyed one (two sessions) alternate, each turn timed; the overhead is the median of the
   paired differences over the median unkeyed turn. Pairs a few hundred microseconds apart
   see the same host, where blocks of 500 turns seconds apart do not (their key overhead has
   read anywhere from -10% to +30% on the same build).
2. Retry latency: a SQLite file holds a session of 10 user messages and one of SIZE (100,000)
   keyed user messages (written with raw INSERTs of the schema's own row shape). The agent is
   started on it, each session is resumed, one keyed prompt is sent, then M retries with the
   same key are timed (mean, p50, p99). Flat means the big session is no slower.
3. The same echo turn against `benchmarks/ts_agent/agent.mjs` (TypeScript SDK 2.4.0, v2 API),
   driven by the same Python client code, twice: with the typed `ClientSideConnection` (every
   update validated into pydantic models, ~400 us of client CPU per turn, which hides much of
   the agents' difference) and with a lean client (the bare JSON-RPC `Connection`, updates
   read as dicts), and a third time with a raw client (blocking pipes and orjson, no event
   loop: ~25 us of client CPU per turn, so the agents alone decide the rate). The reference
   agent (memory store) should reach at least 1.2x its turns/s.
   `npm install` runs in benchmarks/ts_agent when node_modules is missing; without node or
   npm this part is skipped with a message.

Every figure is the median of R rounds of N prompts (default 9 of 500); the configurations of
one comparison alternate round by round, so drift on a busy machine hits both sides alike, and
each ratio (key overhead, SQLite / memory, reference / TypeScript) is the median of the
per-round ratios. Nothing is asserted: this prints figures.

`--profile FILE [--profile-store memory|sqlite]` instead runs only the reference agent under
cProfile for N unkeyed then N keyed echo turns, writes FILE, and prints the top entries (the
SQLite work runs in worker threads, which cProfile does not see: it shows as waiting).
"""

from __future__ import annotations

import argparse
import os
import platform
import pstats
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import anyio
import orjson
from _proc import process_cpu_seconds
from rich.console import Console
from rich.table import Table

from acp_once.agent.state import prompt_digest
from acp_once.client import Client, ClientSideConnection
from acp_once.protocol import schema as s
from acp_once.rpc.connection import Connection
from acp_once.storage import SessionRecord, SqliteStore
from acp_once.transports.stdio import spawn

HERE = Path(__file__).resolve().parent
TS_DIR = HERE / "ts_agent"
TS_AGENT = TS_DIR / "agent.mjs"
CWD = "/tmp/bench"
TEXT = "Run the database migration"
TIMEOUT = 120.0

console = Console(highlight=False, width=max(110, shutil.get_terminal_size().columns))


# -- the client ------------------------------------------------------------------------------


@dataclass
class _SessionView:
    agent_messages: int = 0
    state: str | None = None


@dataclass
class Watcher(Client):
    """Counts what each session reports, so a caller can wait for the end of a turn."""

    sessions: dict[str, _SessionView] = field(default_factory=dict)
    updates: int = 0
    _changed: anyio.Event | None = None  # made by a waiter, set and dropped by the next update

    async def session_update(self, params: s.UpdateSessionNotification) -> None:
        update = params.update
        state = getattr(update, "state", None)
        self.note(
            params.session_id,
            getattr(update, "session_update", None),
            None if state is None else str(getattr(state, "value", state)),
        )

    async def on_raw_notification(self, method: str, params: dict[str, Any] | None) -> None:
        """The lean client's handler: the same bookkeeping on the plain JSON objects."""
        if method == "session/update" and params is not None:
            update = params["update"]
            self.note(params["sessionId"], update.get("sessionUpdate"), update.get("state"))

    def note(self, session_id: str, kind: str | None, state: str | None) -> None:
        self.updates += 1
        view = self.sessions.setdefault(session_id, _SessionView())
        if kind == "agent_message":
            view.agent_messages += 1
        elif kind == "state_update":
            view.state = state
        if self._changed is not None:  # an event per wake-up, not per update (~8 us each)
            self._changed.set()
            self._changed = None

    def view(self, session_id: str) -> _SessionView:
        return self.sessions.setdefault(session_id, _SessionView())

    async def wait_idle_after(self, session_id: str, agent_messages: int) -> None:
        """Until the session has sent `agent_messages` agent messages and is idle again."""
        view = self.view(session_id)
        while view.agent_messages < agent_messages or view.state != "idle":
            if self._changed is None:
                self._changed = anyio.Event()
            await self._changed.wait()


@dataclass
class Driven:
    """One agent process under test, with the client connection that drives it."""

    name: str
    rpc: Connection
    watcher: Watcher
    pid: int

    def cpu_seconds(self) -> float | None:
        return process_cpu_seconds(self.pid)

    async def new_session(self) -> str:
        result = await self.rpc.request("session/new", {"cwd": CWD})
        session_id = result["sessionId"]
        assert isinstance(session_id, str)
        return session_id

    async def resume_session(self, session_id: str) -> None:
        await self.rpc.request("session/resume", {"sessionId": session_id, "cwd": CWD})

    async def prompt(self, session_id: str, *, key: str | None, text: str = TEXT) -> str:
        params: dict[str, Any] = {
            "sessionId": session_id,
            "prompt": [{"type": "text", "text": text}],
        }
        if key is not None:
            params["idempotencyKey"] = key
        result = await self.rpc.request("session/prompt", params)
        message_id = result["messageId"]
        assert isinstance(message_id, str)
        return message_id

    async def turn(self, session_id: str, *, key: str | None) -> None:
        target = self.watcher.view(session_id).agent_messages + 1
        await self.prompt(session_id, key=key)
        await self.watcher.wait_idle_after(session_id, target)


_INITIALIZE = {"protocolVersion": 2, "info": {"name": "bench_agent", "version": "1"}}


@asynccontextmanager
async def driven(
    name: str, command: Sequence[str], *, cwd: Path | None = None, lean: bool = False
) -> AsyncIterator[Driven]:
    """Start an agent and connect a client to it: the typed `ClientSideConnection` (each
    update validated into pydantic models, as an application would), or with `lean` the bare
    JSON-RPC `Connection`, which reads each update as a plain dict (a cheaper instrument, so
    the agents' own costs show more clearly)."""
    watcher = Watcher()
    async with spawn(command, cwd=cwd, stderr=subprocess.DEVNULL) as proc:
        if lean:
            async with Connection(proc.frames, on_notification=watcher.on_raw_notification) as rpc:
                await rpc.request("initialize", _INITIALIZE)
                yield Driven(name, rpc, watcher, proc.pid)
        else:
            async with ClientSideConnection(watcher, proc.frames) as conn:
                await conn.agent.initialize(s.InitializeRequest.model_validate(_INITIALIZE))
                yield Driven(name, conn.rpc, watcher, proc.pid)


class RawDriven:
    """The cheapest client we could write, for measuring agents rather than clients: blocking
    pipes, one `os.read` per wake-up, `orjson`, no event loop, no models. Its own CPU is
    ~15-25 us per echo turn (the typed client's is ~400 us), so the agent decides the rate.
    Same methods and figures as `Driven`, synchronous."""

    def __init__(self, name: str, command: Sequence[str], *, cwd: Path | None = None) -> None:
        self.name = name
        self.proc = subprocess.Popen(
            list(command),
            cwd=cwd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            bufsize=0,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._in = self.proc.stdin
        self._out = self.proc.stdout.fileno()
        self._buffer = b""
        self._next_id = 0
        self.request("initialize", _INITIALIZE)

    def close(self) -> None:
        self._in.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def _read(self) -> dict[str, Any]:
        while True:
            end = self._buffer.find(b"\n")
            if end >= 0:
                line, self._buffer = self._buffer[:end], self._buffer[end + 1 :]
                message: dict[str, Any] = orjson.loads(line)
                return message
            chunk = os.read(self._out, 1 << 16)
            if not chunk:
                raise RuntimeError(f"{self.name}: the agent closed its output")
            self._buffer += chunk

    def _send(self, method: str, params: dict[str, Any]) -> int:
        self._next_id += 1
        frame = {"jsonrpc": "2.0", "id": self._next_id, "method": method, "params": params}
        self._in.write(orjson.dumps(frame) + b"\n")
        return self._next_id

    def request(self, method: str, params: dict[str, Any]) -> Any:
        request_id = self._send(method, params)
        while True:
            message = self._read()
            if message.get("id") == request_id and "method" not in message:
                if "error" in message:
                    raise RuntimeError(f"{self.name}: {method} failed: {message['error']}")
                return message["result"]

    def new_session(self) -> str:
        session_id = self.request("session/new", {"cwd": CWD})["sessionId"]
        assert isinstance(session_id, str)
        return session_id

    def cpu_seconds(self) -> float | None:
        return process_cpu_seconds(self.proc.pid)

    def turns_at_once(self, session_ids: Sequence[str], keys: Sequence[str | None]) -> None:
        """One echo turn in each session (with its key, or none), all prompts sent in one
        write, then read until every prompt is answered and every session is idle again."""
        waiting: dict[int, str] = {}
        frames: list[bytes] = []
        for session_id, key in zip(session_ids, keys, strict=True):
            self._next_id += 1
            params: dict[str, Any] = {
                "sessionId": session_id,
                "prompt": [{"type": "text", "text": TEXT}],
            }
            if key is not None:
                params["idempotencyKey"] = key
            frame = {"jsonrpc": "2.0", "id": self._next_id, "method": "session/prompt"}
            frames.append(orjson.dumps({**frame, "params": params}))
            waiting[self._next_id] = session_id
        self._in.write(b"\n".join(frames) + b"\n")
        busy = set(session_ids)
        while waiting or busy:
            message = self._read()
            if "method" not in message and message.get("id") in waiting:
                if "result" not in message:
                    raise RuntimeError(f"{self.name}: session/prompt failed: {message}")
                del waiting[message["id"]]
            elif message.get("method") == "session/update":
                update = message["params"]["update"]
                if update.get("sessionUpdate") == "state_update" and update.get("state") == "idle":
                    busy.discard(message["params"]["sessionId"])

    def measure(self, session_ids: Sequence[str], n: int, *, keyed: bool) -> Rate:
        """n echo turns spread over the sessions, one turn per session at a time: one session
        is the plain sequential case, several are a client with several sessions busy at once.
        Figures per turn; the keys are made before the clock starts."""
        rounds = max(1, n // len(session_ids))
        keys = [[_key(keyed) for _ in session_ids] for _ in range(rounds)]
        agent_cpu0, client_cpu0 = self.cpu_seconds(), time.process_time()
        start = time.perf_counter()
        for round_keys in keys:
            self.turns_at_once(session_ids, round_keys)
        elapsed = time.perf_counter() - start
        agent_cpu1, client_cpu1 = self.cpu_seconds(), time.process_time()
        turns = rounds * len(session_ids)
        agent_us = (
            None
            if agent_cpu0 is None or agent_cpu1 is None
            else (agent_cpu1 - agent_cpu0) / turns * 1e6
        )
        return Rate(turns / elapsed, agent_us, (client_cpu1 - client_cpu0) / turns * 1e6)


Arm = tuple[RawDriven, str, bool]
"""One side of a turn-by-turn comparison: an agent, a session of it, keyed or not."""


def paired_turns(a: Arm, b: Arm, pairs: int) -> tuple[list[int], list[int]]:
    """`pairs` echo turns on each arm, one of each per pair, the pair's order alternating
    (a b, b a, ...): the nanoseconds each turn took, per arm.

    Two turns of one pair run a few hundred microseconds apart, so a change in the host's
    speed hits both alike; blocks of hundreds of turns, as `alternate` runs, are seconds
    apart, and on a shared host their speed differs by 20-40%.
    """
    arms = (a, b)
    keys = [[_key(keyed) for _ in range(pairs)] for _, _, keyed in arms]
    found: tuple[list[int], list[int]] = ([], [])
    clock = time.perf_counter_ns
    for i in range(pairs):
        for side in (0, 1) if i % 2 == 0 else (1, 0):
            agent, session_id, _ = arms[side]
            key = keys[side][i]
            start = clock()
            agent.turns_at_once([session_id], [key])
            found[side].append(clock() - start)
    return found


@dataclass
class Paired:
    """Turn-by-turn figures of arm `b` against arm `a` (microseconds)."""

    a_us: float  # median turn of a
    b_us: float  # median turn of b
    extra_us: float  # median of the paired differences b - a

    @property
    def extra_pct(self) -> float:
        return self.extra_us / self.a_us * 100


def paired(a: Arm, b: Arm, pairs: int) -> Paired:
    ta, tb = paired_turns(a, b, pairs)
    return Paired(
        statistics.median(ta) / 1e3,
        statistics.median(tb) / 1e3,
        statistics.median(y - x for x, y in zip(ta, tb, strict=True)) / 1e3,
    )


@contextmanager
def raw_driven(
    name: str, command: Sequence[str], *, cwd: Path | None = None
) -> Iterator[RawDriven]:
    agent = RawDriven(name, command, cwd=cwd)
    try:
        yield agent
    finally:
        agent.close()


def reference_command(store: str, effects: Path, *, profile: Path | None = None) -> list[str]:
    python = [sys.executable]
    if profile is not None:
        python += ["-m", "cProfile", "-o", str(profile)]
    return [*python, "-m", "acp_once", "agent", "--store", store, "--side-effects", str(effects)]


# -- measuring -------------------------------------------------------------------------------


@dataclass
class Rate:
    """Operations per second, and CPU microseconds per operation in the agent and client."""

    per_second: float
    agent_cpu_us: float | None
    client_cpu_us: float
    per_round: tuple[float, ...] = ()  # every round's per_second, in round order (median_rate)


def _key(keyed: bool) -> str | None:
    return str(uuid.uuid4()) if keyed else None


async def measure(agent: Driven, session_id: str, n: int, *, keyed: bool, turns: bool) -> Rate:
    """n sequential prompts (turns=False) or n full echo turns (turns=True)."""
    keys = [_key(keyed) for _ in range(n)]
    start_msgs = agent.watcher.view(session_id).agent_messages
    agent_cpu0, client_cpu0 = agent.cpu_seconds(), time.process_time()
    start = time.perf_counter()
    with anyio.fail_after(TIMEOUT):
        if turns:
            for key in keys:
                await agent.turn(session_id, key=key)
        else:
            for key in keys:
                await agent.prompt(session_id, key=key)
    elapsed = time.perf_counter() - start
    agent_cpu1, client_cpu1 = agent.cpu_seconds(), time.process_time()
    with anyio.fail_after(TIMEOUT):  # let the last turns finish before anything else starts
        await agent.watcher.wait_idle_after(session_id, start_msgs + n)
    agent_us = (
        None if agent_cpu0 is None or agent_cpu1 is None else (agent_cpu1 - agent_cpu0) / n * 1e6
    )
    return Rate(n / elapsed, agent_us, (client_cpu1 - client_cpu0) / n * 1e6)


def median_rate(rates: list[Rate]) -> Rate:
    middle = sorted(rates, key=lambda r: r.per_second)[len(rates) // 2]
    return replace(middle, per_round=tuple(r.per_second for r in rates))


def speed_ratio(a: Rate, b: Rate) -> float:
    """How many times faster `a` ran than `b`: the median of their per-round ratios.

    The cases of one round run back to back, so a ratio within a round is taken under one
    load of the host; on a shared machine whose speed drifts by 20-40% within a minute, the
    median of those ratios moves far less than the ratio of the two medians.
    """
    if len(a.per_round) != len(b.per_round) or not a.per_round:
        return a.per_second / b.per_second
    return statistics.median(x / y for x, y in zip(a.per_round, b.per_round, strict=True))


async def alternate(
    rounds: int, cases: dict[str, Callable[[], Awaitable[Rate]]]
) -> dict[str, Rate]:
    """Run every case once per round, in an order that rotates; the median per case."""
    results: dict[str, list[Rate]] = {name: [] for name in cases}
    names = list(cases)
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            results[name].append(await cases[name]())
    return {name: median_rate(rates) for name, rates in results.items()}


# -- 1. throughput ---------------------------------------------------------------------------


@dataclass
class Throughput:
    # (store, keyed, turns) -> Rate
    rates: dict[tuple[str, bool, bool], Rate]


async def bench_throughput(n: int, rounds: int, tmp: Path) -> Throughput:
    """Both agents run at once and the four cases of a workload (store x key) alternate
    round by round, so a change in the machine's load hits every case alike."""
    rates: dict[tuple[str, bool, bool], Rate] = {}
    urls = {"memory": "memory:", "sqlite": f"sqlite:{tmp / 'throughput.sqlite3'}"}
    async with (
        driven("reference/memory", reference_command(urls["memory"], tmp / "fx1")) as memory,
        driven("reference/sqlite", reference_command(urls["sqlite"], tmp / "fx2")) as sqlite,
    ):
        agents = {"memory": memory, "sqlite": sqlite}
        sessions = {
            (store, keyed): await agent.new_session()
            for store, agent in agents.items()
            for keyed in (False, True)
        }
        for (store, keyed), sid in sessions.items():  # warm up: imports, caches
            await measure(agents[store], sid, min(n, 200), keyed=keyed, turns=True)
        for turns in (False, True):
            cases: dict[str, Callable[[], Awaitable[Rate]]] = {}
            for (store, keyed), sid in sessions.items():

                def case(
                    agent: Driven = agents[store],
                    sid: str = sid,
                    keyed: bool = keyed,
                    turns: bool = turns,
                ) -> Awaitable[Rate]:
                    return measure(agent, sid, n, keyed=keyed, turns=turns)

                cases[f"{store}/{keyed}"] = case
            found = await alternate(rounds, cases)
            for store, keyed in sessions:
                rates[(store, keyed, turns)] = found[f"{store}/{keyed}"]
    return Throughput(rates)


async def bench_stores_raw(n: int, rounds: int, tmp: Path) -> dict[str, Rate]:
    """Echo turns, memory against SQLite, keyed and unkeyed, driven by the raw client (so the
    store's cost is not hidden behind the typed client's ~400 us per turn)."""
    urls = {"memory": "memory:", "sqlite": f"sqlite:{tmp / 'raw.sqlite3'}"}
    with (
        raw_driven("reference/memory", reference_command(urls["memory"], tmp / "fr1")) as memory,
        raw_driven("reference/sqlite", reference_command(urls["sqlite"], tmp / "fr2")) as sqlite,
    ):
        cases: dict[str, Callable[[], Awaitable[Rate]]] = {}
        for store, agent in (("memory", memory), ("sqlite", sqlite)):
            for keyed in (False, True):
                sid = agent.new_session()
                agent.measure([sid], min(n, 300), keyed=keyed)  # warm up

                async def case(agent: RawDriven = agent, sid: str = sid, k: bool = keyed) -> Rate:
                    return agent.measure([sid], n, keyed=k)

                cases[f"{store}/{'keyed' if keyed else 'unkeyed'}"] = case
        return await alternate(rounds, cases)


def bench_key_pairs(pairs: int, tmp: Path) -> dict[str, Paired]:
    """The key's cost turn by turn (`paired`), raw client: in each store's agent, a keyed
    session against an unkeyed one of the same process.

    Only arms of one process are paired: two agents alternating turn by turn each wake up
    cold for every turn (their caches taken by the other), which measures a different thing
    than the turns per second of an agent kept busy; those comparisons stay with `alternate`.
    With SQLite, the checkpoints a keyed session makes costlier run in their own thread and
    land on the turns of both arms, mostly in the tail: the figure leaves most of that out.
    """
    urls = {"memory": "memory:", "sqlite": f"sqlite:{tmp / 'pairs.sqlite3'}"}
    found: dict[str, Paired] = {}
    for store, url in urls.items():
        with raw_driven(f"reference/{store}", reference_command(url, tmp / f"fp-{store}")) as agent:
            plain = (agent, agent.new_session(), False)
            keyed = (agent, agent.new_session(), True)
            paired_turns(plain, keyed, min(pairs, 300))  # warm up
            found[store] = paired(plain, keyed, pairs)
    return found


def print_key_pairs(found: dict[str, Paired], pairs: int) -> float:
    """Print `bench_key_pairs`; return the key's worse overhead (%)."""
    table = Table(title=f"1c. The key's cost turn by turn, raw client ({pairs:,} pairs, medians)")
    for col in ("store", "unkeyed us", "keyed us", "keyed - unkeyed us (paired)", "overhead"):
        table.add_column(col, justify="left" if col == "store" else "right")
    for store, p in found.items():
        table.add_row(
            store, f"{p.a_us:,.0f}", f"{p.b_us:,.0f}", f"{p.extra_us:+,.1f}", f"{p.extra_pct:+.1f}%"
        )
    console.print(table)
    return max(p.extra_pct for p in found.values())


def rate_table(title: str, first: str, found: dict[str, Rate]) -> Table:
    """One row per named `Rate`: turns/s, us each, agent and client CPU us per turn."""
    table = Table(title=title)
    for col in (first, "turns/s", "us each", "agent CPU us", "client CPU us"):
        table.add_column(col, justify="left" if col == first else "right")
    for name, rate in found.items():
        table.add_row(
            name,
            f"{rate.per_second:,.0f}",
            f"{1e6 / rate.per_second:,.0f}",
            _cpu(rate.agent_cpu_us),
            _cpu(rate.client_cpu_us),
        )
    return table


def print_stores_raw(found: dict[str, Rate], n: int, rounds: int) -> float:
    title = f"1b. Echo turns, raw client (median of {rounds} rounds of {n}): the stores' cost"
    console.print(rate_table(title, "store / key", found))
    ratios = {
        keyed: speed_ratio(found[f"sqlite/{keyed}"], found[f"memory/{keyed}"])
        for keyed in ("unkeyed", "keyed")
    }
    overheads = {
        store: (speed_ratio(found[f"{store}/unkeyed"], found[f"{store}/keyed"]) - 1) * 100
        for store in ("memory", "sqlite")
    }
    console.print(
        f"raw client: SQLite / memory {ratios['unkeyed']:.2f} unkeyed, {ratios['keyed']:.2f}"
        f" keyed; key overhead {overheads['memory']:+.1f}% memory, {overheads['sqlite']:+.1f}%"
        " SQLite"
    )
    return min(ratios.values())


def _cpu(value: float | None) -> str:
    return "n/a" if value is None else f"{value:,.0f}"


def print_throughput(t: Throughput, n: int, rounds: int) -> tuple[float, float]:
    table = Table(title=f"1. Reference agent over stdio (median of {rounds} rounds of {n} prompts)")
    for col in (
        "store",
        "workload",
        "key",
        "per second",
        "us each",
        "agent CPU us",
        "client CPU us",
    ):
        table.add_column(col, justify="left" if col in ("store", "workload", "key") else "right")
    for (store, keyed, turns), rate in t.rates.items():
        table.add_row(
            store,
            "echo turns" if turns else "sequential prompts",
            "fresh uuid" if keyed else "none",
            f"{rate.per_second:,.0f}",
            f"{1e6 / rate.per_second:,.0f}",
            _cpu(rate.agent_cpu_us),
            _cpu(rate.client_cpu_us),
        )
    console.print(table)

    derived = Table(title="Key overhead and SQLite/memory")
    for col in ("figure", "sequential prompts", "echo turns", "target"):
        derived.add_column(col, justify="left" if col == "figure" else "right")
    worst_overhead = 0.0
    worst_ratio = float("inf")
    for store in ("memory", "sqlite"):
        cells = []
        for turns in (False, True):
            plain_rate = t.rates[(store, False, turns)]
            keyed_rate = t.rates[(store, True, turns)]
            # extra time per prompt with a key
            overhead = (speed_ratio(plain_rate, keyed_rate) - 1) * 100
            worst_overhead = max(worst_overhead, overhead)
            cells.append(f"{overhead:+.1f}%")
        derived.add_row(f"key overhead, {store}", *cells, "< 5%")
    for keyed in (False, True):
        cells = []
        for turns in (False, True):
            ratio = speed_ratio(
                t.rates[("sqlite", keyed, turns)], t.rates[("memory", keyed, turns)]
            )
            worst_ratio = min(worst_ratio, ratio)
            cells.append(f"{ratio:.2f}")
        label = f"sqlite / memory, {'keyed' if keyed else 'unkeyed'}"
        derived.add_row(label, *cells, "0.7-0.8 accepted")
    # The same figures from the agent's CPU time per prompt, which moves far less with the
    # machine's load than wall time does (informative; the targets are on wall time).
    for store in ("memory", "sqlite"):
        cells = []
        for turns in (False, True):
            plain_cpu = t.rates[(store, False, turns)].agent_cpu_us
            keyed_cpu = t.rates[(store, True, turns)].agent_cpu_us
            if plain_cpu and keyed_cpu:
                cells.append(f"{(keyed_cpu / plain_cpu - 1) * 100:+.1f}%")
            else:
                cells.append("n/a")
        derived.add_row(f"agent CPU: key overhead, {store}", *cells, "")
    for keyed in (False, True):
        cells = []
        for turns in (False, True):
            memory_cpu = t.rates[("memory", keyed, turns)].agent_cpu_us
            sqlite_cpu = t.rates[("sqlite", keyed, turns)].agent_cpu_us
            if memory_cpu and sqlite_cpu:
                cells.append(f"{memory_cpu / sqlite_cpu:.2f}")
            else:
                cells.append("n/a")
        label = "keyed" if keyed else "unkeyed"
        derived.add_row(f"agent CPU: memory / sqlite, {label}", *cells, "")
    console.print(derived)
    return worst_overhead, worst_ratio


# -- 2. retry latency ------------------------------------------------------------------------


def _user_update(message_id: str, text: str) -> bytes:
    return orjson.dumps(
        {
            "sessionUpdate": "user_message",
            "messageId": message_id,
            "content": [{"type": "text", "text": text}],
        }
    )


async def build_history(path: Path, sizes: dict[str, int]) -> None:
    """Sessions with `size` keyed user messages each: the small ones through the store's own
    insert, the big ones with one raw executemany of the schema's row shape (the lookup, not
    the insert, is what is measured)."""
    now = time.time()
    digest = prompt_digest([s.ContentBlockText(type="text", text="history")])
    async with SqliteStore.open(path) as store:
        for sid, size in sizes.items():
            await store.create_session(SessionRecord(sid, CWD, (), None, now, now))
            if size <= 1_000:
                for i in range(size):
                    mid = f"msg_user_{sid}_{i}"
                    await store.insert_user_message(
                        sid,
                        message_id=mid,
                        update=_user_update(mid, "history"),
                        idempotency_key=f"history-{i}",
                        prompt_digest=digest,
                    )
    big = {sid: size for sid, size in sizes.items() if size > 1_000}
    if not big:
        return
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        for sid, size in big.items():
            conn.executemany(
                "INSERT INTO timeline (session_id, seq, message_id, payload, is_user_message,"
                " idempotency_key, prompt_digest) VALUES (?, ?, ?, ?, 1, ?, ?)",
                (
                    (
                        sid,
                        i + 1,
                        f"msg_user_{sid}_{i}",
                        _user_update(f"msg_user_{sid}_{i}", "history"),
                        f"history-{i}",
                        digest,
                    )
                    for i in range(size)
                ),
            )
        conn.execute("COMMIT")
    finally:
        conn.close()


@dataclass
class Latency:
    messages: int
    mean_us: float
    p50_us: float
    p99_us: float
    max_us: float
    stored_once: bool


async def bench_retry(retries: int, big: int, tmp: Path) -> list[Latency]:
    path = tmp / "history.sqlite3"
    sizes = {"sess_small": 10, "sess_big": big}
    started = time.perf_counter()
    await build_history(path, sizes)
    console.print(
        f"[dim]history built: {sum(sizes.values()):,} rows in"
        f" {time.perf_counter() - started:.1f} s[/dim]"
    )
    key = str(uuid.uuid4())
    samples: dict[str, list[float]] = {}
    first_ids: dict[str, str] = {}
    async with driven("reference/sqlite", reference_command(f"sqlite:{path}", tmp / "fx")) as ag:
        for sid in sizes:
            await ag.resume_session(sid)
            with anyio.fail_after(TIMEOUT):
                await ag.turn(sid, key=key)  # inserted once, and its turn is over
                first_ids[sid] = await ag.prompt(sid, key=key)
            for _ in range(min(100, retries)):  # warm up
                await ag.prompt(sid, key=key)
        # alternate the sessions in blocks, so drift hits both alike
        block = 100
        for sid in sizes:
            samples[sid] = []
        with anyio.fail_after(TIMEOUT):
            for done in range(0, retries, block):
                for sid in sizes:
                    for _ in range(min(block, retries - done)):
                        t0 = time.perf_counter()
                        message_id = await ag.prompt(sid, key=key)
                        samples[sid].append(time.perf_counter() - t0)
                        if message_id != first_ids[sid]:
                            raise RuntimeError("a retry got a different messageId")
    results = []
    async with SqliteStore.open(path) as store:
        for sid, size in sizes.items():
            xs = sorted(samples[sid])
            once = await store.count_user_messages(sid, idempotency_key=key) == 1
            total = await store.count_user_messages(sid)
            results.append(
                Latency(
                    messages=size,
                    mean_us=statistics.fmean(xs) * 1e6,
                    p50_us=xs[len(xs) // 2] * 1e6,
                    p99_us=xs[min(len(xs) - 1, int(len(xs) * 0.99))] * 1e6,
                    max_us=xs[-1] * 1e6,
                    stored_once=once and total == size + 1,
                )
            )
    return results


def print_retry(results: list[Latency], retries: int) -> float:
    table = Table(
        title=f"2. Retry latency over stdio, SQLite store ({retries:,} retries of one key each)"
    )
    for col in ("session history", "mean us", "p50 us", "p99 us", "max us", "inserted once"):
        table.add_column(col, justify="left" if col == "session history" else "right")
    for r in results:
        table.add_row(
            f"{r.messages:,} messages",
            f"{r.mean_us:,.0f}",
            f"{r.p50_us:,.0f}",
            f"{r.p99_us:,.0f}",
            f"{r.max_us:,.0f}",
            "yes" if r.stored_once else "NO",
        )
    console.print(table)
    small, big = results[0], results[-1]
    ratio = big.mean_us / small.mean_us
    console.print(
        f"big/small: mean {ratio:.2f}x, p99 {big.p99_us / small.p99_us:.2f}x (flat is ~1.0)"
    )
    return ratio


# -- 3. TypeScript SDK side by side ----------------------------------------------------------


def prepare_ts_agent() -> str | None:
    """None when the TS agent can run; otherwise why it cannot."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None:
        return "node is not installed"
    if not (TS_DIR / "node_modules" / "@agentclientprotocol" / "sdk").is_dir():
        if npm is None:
            return "npm is not installed (needed once, to install the SDK)"
        console.print(
            "[dim]installing the TypeScript SDK: npm install in benchmarks/ts_agent[/dim]"
        )
        try:
            done = subprocess.run(
                [npm, "install", "--no-audit", "--no-fund"],
                cwd=TS_DIR,
                capture_output=True,
                text=True,
                timeout=300,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"npm install failed: {exc}"
        if done.returncode != 0:
            return f"npm install failed ({done.returncode}): {done.stderr.strip()[-500:]}"
    return None


REF_PLAIN = "reference, memory store, no key"
REF_KEYED = "reference, memory store, fresh key"
TS_PLAIN = "TypeScript SDK 2.4.0 v2 agent, no key"


async def bench_ts_raw(n: int, rounds: int, tmp: Path, sessions: int = 1) -> dict[str, Rate]:
    """The raw client, one session at a time, or `sessions` sessions busy at once (one turn
    each at a time)."""
    node = shutil.which("node")
    assert node is not None
    with (
        raw_driven("reference/memory", reference_command("memory:", tmp / f"fx{sessions}")) as ref,
        raw_driven("typescript", [node, str(TS_AGENT)], cwd=TS_DIR) as ts,
    ):
        ref_plain = [ref.new_session() for _ in range(sessions)]
        ref_keyed = [ref.new_session() for _ in range(sessions)]
        ts_sids = [ts.new_session() for _ in range(sessions)]
        for agent, sids, keyed in (
            (ref, ref_plain, False),
            (ref, ref_keyed, True),
            (ts, ts_sids, False),
        ):
            agent.measure(sids, min(n, 300), keyed=keyed)  # warm up (the JIT, imports)

        async def ref_unkeyed() -> Rate:
            return ref.measure(ref_plain, n, keyed=False)

        async def ref_with_key() -> Rate:
            return ref.measure(ref_keyed, n, keyed=True)

        async def ts_unkeyed() -> Rate:
            return ts.measure(ts_sids, n, keyed=False)

        return await alternate(
            rounds, {REF_PLAIN: ref_unkeyed, REF_KEYED: ref_with_key, TS_PLAIN: ts_unkeyed}
        )


async def bench_ts(n: int, rounds: int, tmp: Path, *, lean: bool) -> dict[str, Rate]:
    node = shutil.which("node")
    assert node is not None
    async with (
        driven("reference/memory", reference_command("memory:", tmp / "fx3"), lean=lean) as ref,
        driven("typescript", [node, str(TS_AGENT)], cwd=TS_DIR, lean=lean) as ts,
    ):
        ref_plain, ref_keyed, ts_sid = (
            await ref.new_session(),
            await ref.new_session(),
            await ts.new_session(),
        )
        for agent, sid, keyed in (
            (ref, ref_plain, False),
            (ref, ref_keyed, True),
            (ts, ts_sid, False),
        ):
            await measure(agent, sid, min(n, 200), keyed=keyed, turns=True)

        async def ref_unkeyed() -> Rate:
            return await measure(ref, ref_plain, n, keyed=False, turns=True)

        async def ref_with_key() -> Rate:
            return await measure(ref, ref_keyed, n, keyed=True, turns=True)

        async def ts_unkeyed() -> Rate:
            return await measure(ts, ts_sid, n, keyed=False, turns=True)

        return await alternate(
            rounds, {REF_PLAIN: ref_unkeyed, REF_KEYED: ref_with_key, TS_PLAIN: ts_unkeyed}
        )


def print_ts(found: dict[str, Rate], n: int, rounds: int, client: str) -> float:
    title = f"3. Echo turns over stdio, {client} (median of {rounds} rounds of {n})"
    console.print(rate_table(title, "agent", found))
    plain = speed_ratio(found[REF_PLAIN], found[TS_PLAIN])
    keyed = speed_ratio(found[REF_KEYED], found[TS_PLAIN])
    console.print(
        f"reference / TypeScript, {client}: {plain:.2f}x without a key, {keyed:.2f}x with one"
        " (target >= 1.2x)"
    )
    ts_cpu = found[TS_PLAIN].agent_cpu_us
    ref_cpu = found[REF_PLAIN].agent_cpu_us
    if ts_cpu and ref_cpu:
        console.print(
            f"agent CPU per turn: reference {ref_cpu:,.0f} us, TypeScript {ts_cpu:,.0f} us"
            f" ({ref_cpu / ts_cpu:.2f}x)"
        )
    return min(plain, keyed)


# -- profile -----------------------------------------------------------------------------------


async def profile_reference(n: int, out: Path, store: str, tmp: Path) -> None:
    url = "memory:" if store == "memory" else f"sqlite:{tmp / 'profile.sqlite3'}"
    command = reference_command(url, tmp / "fxp", profile=out)
    async with driven(f"reference/{store} (cProfile)", command) as agent:
        sid = await agent.new_session()
        for keyed in (False, True):
            await measure(agent, sid, n, keyed=keyed, turns=True)
    # leaving the block closes stdin; the agent exits cleanly and cProfile writes `out`


def print_profile(out: Path, top: int = 35) -> None:
    console.print(f"\n[bold]Top {top} by cumulative time, reference agent ({out})[/bold]")
    stats = pstats.Stats(str(out))
    stats.sort_stats("cumulative").print_stats(top)
    stats.sort_stats("tottime").print_stats(20)


# -- main --------------------------------------------------------------------------------------


def _load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def _verdict(ok: bool) -> str:
    return "[green]met[/green]" if ok else "[red]MISSED[/red]"


async def main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-agent-") as tmp_name:
        tmp = Path(tmp_name)
        if args.profile is not None:
            await profile_reference(args.n, Path(args.profile), args.profile_store, tmp)
            print_profile(Path(args.profile))
            return
        console.print(
            f"[bold]bench_agent[/bold] {time.strftime('%Y-%m-%d %H:%M')}  "
            f"Python {platform.python_version()}  {platform.machine()}  "
            f"{os.cpu_count()} cores  N={args.n} rounds={args.rounds} retries={args.retries}"
        )
        console.print(f"load average at start: {_load()}")
        began = time.perf_counter()
        summary = Table(title="Targets")
        for col in ("target", "measured", "verdict"):
            summary.add_column(col)
        if "throughput" in args.only:
            through = await bench_throughput(args.n, args.rounds, tmp)
            overhead, ratio = print_throughput(through, args.n, args.rounds)
            summary.add_row(
                "key overhead < 5% (worst case)", f"{overhead:+.1f}%", _verdict(overhead < 5)
            )
            # issue 23: one durable commit per sequential prompt puts SQLite at 0.7-0.8x
            # memory, accepted; the durable store's target is at concurrency (bench_load*.py)
            summary.add_row(
                "SQLite / memory, sequential turns: 0.7-0.8 accepted (worst case), typed client",
                f"{ratio:.2f}",
                "[green]accepted[/green]" if ratio >= 0.7 else "[yellow]below 0.7[/yellow]",
            )
            raw = await bench_stores_raw(args.n, args.rounds, tmp)
            raw_ratio = print_stores_raw(raw, args.n, args.rounds)
            summary.add_row(
                "(no target) SQLite / memory (worst case), raw client",
                f"{raw_ratio:.2f}",
                "[dim]figure[/dim]",
            )
            pairs = args.n * args.rounds
            pair_overhead = print_key_pairs(bench_key_pairs(pairs, tmp), pairs)
            summary.add_row(
                "key overhead < 5% (worse store), turn by turn, raw client",
                f"{pair_overhead:+.1f}%",
                _verdict(pair_overhead < 5),
            )
        if "retry" in args.only:
            retry = await bench_retry(args.retries, args.big, tmp)
            flat = print_retry(retry, args.retries)
            summary.add_row(
                "retry latency flat (big/small mean)", f"{flat:.2f}x", _verdict(flat < 1.25)
            )
        if "ts" in args.only:
            why = "skipped (--no-ts)" if args.no_ts else prepare_ts_agent()
            if why is None:
                for client in ("typed client", "lean client", "raw client"):
                    if client == "raw client":
                        found = await bench_ts_raw(args.n, args.rounds, tmp)
                    else:
                        found = await bench_ts(
                            args.n, args.rounds, tmp, lean=client == "lean client"
                        )
                    ts_ratio = print_ts(found, args.n, args.rounds, client)
                    summary.add_row(
                        f"reference (memory) / TS SDK >= 1.2x, {client} (worst of keyed, unkeyed)",
                        f"{ts_ratio:.2f}x",
                        _verdict(ts_ratio >= 1.2),
                    )
                k = args.sessions
                found = await bench_ts_raw(args.n, args.rounds, tmp, k)
                client = f"raw client, {k} sessions busy at once"
                ts_ratio = print_ts(found, args.n, args.rounds, client)
                summary.add_row(
                    f"(not the target's setting) reference / TS SDK, {client}",
                    f"{ts_ratio:.2f}x",
                    "[dim]figure[/dim]",
                )
            else:
                console.print(f"[yellow]3. TypeScript SDK comparison skipped: {why}[/yellow]")
        console.print(summary)
        console.print(
            f"[dim]total {time.perf_counter() - began:.0f} s; load average at end: {_load()}"
            " (other work on the machine skews the figures)[/dim]"
        )


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("n", nargs="?", type=int, default=500, help="prompts per round")
    parser.add_argument("--rounds", type=int, default=9, help="rounds per figure (median)")
    parser.add_argument("--retries", type=int, default=2_000, help="timed retries per session")
    parser.add_argument("--big", type=int, default=100_000, help="messages in the big session")
    parser.add_argument("--no-ts", action="store_true", help="skip the TypeScript comparison")
    parser.add_argument(
        "--sessions", type=int, default=8, help="sessions busy at once in part 3's last figure"
    )
    parser.add_argument(
        "--only",
        type=lambda text: set(text.split(",")),
        default={"throughput", "retry", "ts"},
        help="parts to run, comma-separated: throughput,retry,ts (default: all)",
    )
    parser.add_argument("--profile", metavar="FILE", help="cProfile the reference agent only")
    parser.add_argument(
        "--profile-store", choices=("memory", "sqlite"), default="memory", help="for --profile"
    )
    return parser.parse_args(argv)


if __name__ == "__main__":
    anyio.run(main, parse_args(sys.argv[1:]))
