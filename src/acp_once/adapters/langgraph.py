"""An ACP v2 agent whose sessions live in a LangGraph checkpointer: the adapter kit, for real.

`acp-once agent --runtime langgraph --store sqlite:PATH` runs it (needs
`pip install 'acp-once[langgraph]'`). Each ACP session is a LangGraph thread (thread id = session
id) of a small graph: a `messages` channel with LangGraph's `add_messages` reducer holds the
conversation as LangChain messages, and a model node answers a user message with a fake chat
model shipped by langchain-core (`ParrotFakeChatModel`, which echoes), so it runs offline.

Keys follow the RFD's technique for adapters (`acp_once.agent.adapter.AdapterKeys`): a keyed
prompt's user message is stored in the thread as a `HumanMessage` whose `id` is
`derive_message_id(session_id, key)`, and before anything is submitted that id is looked up in a
per-session cache of the thread's user-message ids, read from the checkpointer once per session
per process. The adapter keeps no key table: after a restart the only record of a key is the
message id inside LangGraph's stored thread.

`LangGraphStore` is the glue: it presents the threads as a `SessionStore`, so `SessionAgent`
runs held prompts, cancellation, privacy and the rest of the key rules exactly as over our own
stores. Where it differs from them:

- `insert_user_message` stores the message under an id of its choosing (derived for a keyed
  prompt, a random UUID otherwise), not the one the runtime proposed; `LangGraphAgent` announces
  the stored id.
- A recorded key comes back without a prompt digest, so a key reused with a different prompt is
  answered as a retry (the RFD allows it): `--compare-prompts` has no effect here.
- Everything retained lives in the thread: user and agent messages as LangChain messages, other
  retained updates (tool calls, the turns' end records, the runtime's markers) in an `events`
  channel that records where in the conversation they happened. The session directory (cwd,
  title, timestamps, used by `session/list`) is kept in LangGraph's own key-value store, in the
  same SQLite file.
- A LangGraph thread has one writer at a time: every write of a thread (a message, an event, a
  model run) holds that thread's lock, since two writers starting from the same checkpoint
  would each drop the other's write. Two agent processes must not share one checkpointer.

The turn is the reference agent's script (`[work:SECONDS]`, `[tool]`, `/cmd` live-only, the
`ACP_ONCE_CRASH=after-insert` crash point, see `acp_once.agent.reference`), with the answer made
by the graph's model node.
"""

from __future__ import annotations

import collections
import operator
import re
import sqlite3
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, TypedDict

import anyio
import orjson

from acp_once.agent.adapter import AdapterKeys, derive_message_id
from acp_once.agent.reference import ReferenceAgent
from acp_once.protocol.vocabulary import Extension, StopReason
from acp_once.storage.base import (
    ANY_TENANT,
    UNCHANGED,
    AnyTenant,
    InsertOutcome,
    KeyRecord,
    SessionExists,
    SessionMissing,
    SessionRecord,
    StorageError,
    TimelineEntry,
    Unchanged,
    check_limit,
    decode_cursor,
    encode_cursor,
)

EXTRA_HINT = "the LangGraph adapter needs its extra: pip install 'acp-once[langgraph]'"

try:
    from langchain_core.language_models.chat_models import BaseChatModel
    from langchain_core.language_models.fake_chat_models import ParrotFakeChatModel
    from langchain_core.messages import AIMessage, AnyMessage, BaseMessage, HumanMessage
    from langchain_core.runnables import RunnableConfig
    from langgraph.checkpoint.base import BaseCheckpointSaver
    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.checkpoint.sqlite.aio import AsyncSqliteSaver
    from langgraph.graph import END, START, StateGraph
    from langgraph.graph.message import add_messages
    from langgraph.store.base import BaseStore, GetOp, Item, Op, PutOp, Result, SearchOp
    from langgraph.store.memory import InMemoryStore
    from langgraph.store.sqlite.aio import AsyncSqliteStore
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(EXTRA_HINT) from exc

if TYPE_CHECKING:
    from langgraph.graph.state import CompiledStateGraph

    from acp_once.agent.runtime import HeldPolicy, Turn, TurnContext

__all__ = ["EXTRA_HINT", "LangGraphAgent", "LangGraphStore", "ThreadState"]

_SESSIONS = ("acp_once", "sessions")  # the session directory's namespace in LangGraph's store
_PAGE = 1000
_INSERT_TIMEOUT = 60.0  # seconds: a user message written to its thread (or the directory), shielded
_WORK = re.compile(r"\[work:(\d+(?:\.\d+)?)\]")  # as in the reference agent


class ThreadState(TypedDict, total=False):
    """The state of one session's LangGraph thread."""

    messages: Annotated[list[AnyMessage], add_messages]
    """The conversation: `HumanMessage` (id = the ACP messageId), `AIMessage` answers."""
    events: Annotated[list[dict[str, Any]], operator.add]
    """Other retained updates: `{"at": messages before it, "update": ..., "messageId": ...}`."""
    event: dict[str, Any] | None
    """Input of a run that records one event."""
    reply_to: str | None
    """Input of a run that answers the user message with this id."""


def _build_graph(model: BaseChatModel) -> StateGraph[ThreadState]:
    async def respond(state: ThreadState) -> dict[str, Any]:
        target = state.get("reply_to")
        question = next((m for m in reversed(state.get("messages", [])) if m.id == target), None)
        text = _text(question.content) if question is not None else ""
        # the model sees the text only: an id-less copy, so its echo cannot replace the question
        answer = await model.ainvoke([HumanMessage(content=text)])
        reply = AIMessage(id=f"msg_agent_{uuid.uuid4().hex}", content=_text(answer.content))
        return {"messages": [reply], "reply_to": None}

    async def record(state: ThreadState) -> dict[str, Any]:
        event = dict(state.get("event") or {})
        event["at"] = len(state.get("messages", []))
        return {"events": [event], "event": None}

    def route(state: ThreadState) -> str:
        if state.get("event") is not None:
            return "record"
        if state.get("reply_to") is not None:
            return "respond"
        return END

    graph = StateGraph(ThreadState)
    graph.add_node("respond", respond)
    graph.add_node("record", record)
    graph.add_conditional_edges(START, route, ["respond", "record", END])
    graph.add_edge("respond", END)
    graph.add_edge("record", END)
    return graph


def _text(content: Any) -> str:
    """The text of LangChain message content (a string, or a list of content blocks)."""
    if isinstance(content, str):
        return content
    parts = [
        b["text"]
        for b in content
        if isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str)
    ]
    return "\n".join(parts)


def _record_of(session_id: str, value: dict[str, Any]) -> SessionRecord:
    return SessionRecord(
        session_id=session_id,
        cwd=value["cwd"],
        additional_directories=tuple(value.get("additional_directories") or ()),
        title=value.get("title"),
        created_at=float(value["created_at"]),
        updated_at=float(value["updated_at"]),
        forked_from=value.get("forked_from"),
        tenant=value.get("tenant"),  # absent in values written before tenants: no tenant
    )


def _value_of(record: SessionRecord) -> dict[str, Any]:
    return {
        "cwd": record.cwd,
        "additional_directories": list(record.additional_directories),
        "title": record.title,
        "created_at": record.created_at,
        "updated_at": record.updated_at,
        "forked_from": record.forked_from,
        "tenant": record.tenant,
    }


class _Directory:
    """The session directory in LangGraph's key-value store, one operation per transaction.

    LangGraph's stores merge the operations that callers start at the same time into one batch,
    and `AsyncSqliteStore` runs a batch as one deferred transaction: its reads, then its writes.
    Such a transaction that read before another connection to the file (the checkpointer's)
    committed cannot become a writer: SQLite answers "database is locked" at once, without
    waiting out its busy timeout. Sent alone (`abatch` of one operation), a read is a read-only
    transaction and a write starts as a writer, which waits for the lock instead.

    Each operation is shielded (bounded): `AsyncSqliteStore` ends its transaction in a
    `finally`, which a cancelled caller would skip, leaving the connection inside a transaction
    that fails every later operation.
    """

    def __init__(self, store: BaseStore) -> None:
        self.store = store

    async def get(self, key: str) -> Item | None:
        (item,) = await self._run(GetOp(_SESSIONS, key, refresh_ttl=False))
        assert item is None or isinstance(item, Item)
        return item

    async def put(self, key: str, value: dict[str, Any] | None) -> None:
        """Store `value` under `key` (None: delete it)."""
        await self._run(PutOp(_SESSIONS, key, value))

    async def search(self, *, filter: dict[str, Any] | None, offset: int) -> list[Item]:
        (items,) = await self._run(SearchOp(_SESSIONS, filter, _PAGE, offset, refresh_ttl=False))
        assert isinstance(items, list)
        return [item for item in items if isinstance(item, Item)]

    async def _run(self, op: Op) -> list[Result]:
        with anyio.move_on_after(_INSERT_TIMEOUT, shield=True):
            with _storage_errors():
                return await self.store.abatch([op])
        raise StorageError(f"the session directory took over {_INSERT_TIMEOUT:.0f} s")


@contextmanager
def _storage_errors() -> Iterator[None]:
    """LangGraph's SQLite parts raise `sqlite3.Error` (its store: a `ValueError` caused by one);
    a `SessionStore` raises `StorageError`.

    Only SQLite's own message is kept: it names tables and columns, never the values, while the
    store's `ValueError` quotes the query's parameters.
    """
    try:
        yield
    except (sqlite3.Error, ValueError) as exc:
        cause = exc if isinstance(exc, sqlite3.Error) else exc.__cause__
        if not isinstance(cause, sqlite3.Error):
            raise
        raise StorageError(f"the LangGraph database: {cause}") from exc


def _config(session_id: str) -> RunnableConfig:
    return {"configurable": {"thread_id": session_id}}


class LangGraphStore:
    """A `SessionStore` whose sessions are threads of a LangGraph checkpointer.

    Open it with `LangGraphStore.open("sqlite:PATH")` (`AsyncSqliteSaver` and `AsyncSqliteStore`
    on one file, durable) or `"memory:"` (`InMemorySaver`, for tests), or pass your own
    checkpointer and store. Keys are never written anywhere: a keyed user message is stored with
    its derived id, and `keys` (an `AdapterKeys`) finds it again.

    `history_reads` counts, per session, the reads of a thread's user-message ids that filled
    the key cache (at most one per session per process, unless a read failed or a submit was
    cancelled).
    """

    def __init__(
        self,
        checkpointer: BaseCheckpointSaver[Any],
        directory: BaseStore,
        *,
        model: BaseChatModel | None = None,
    ) -> None:
        self.checkpointer = checkpointer
        self.directory = directory
        self._sessions = _Directory(directory)
        self.graph: CompiledStateGraph[ThreadState] = _build_graph(
            model or ParrotFakeChatModel()
        ).compile(checkpointer=checkpointer)
        self.keys = AdapterKeys()
        self.history_reads: collections.Counter[str] = collections.Counter()
        self._locks: dict[str, anyio.Lock] = collections.defaultdict(anyio.Lock)
        self._assigned: dict[str, str] = {}
        self._closed = False

    @classmethod
    @asynccontextmanager
    async def open(
        cls, url: str, *, model: BaseChatModel | None = None
    ) -> AsyncIterator[LangGraphStore]:
        """Open the threads named by `url` for the `async with` block.

        * `memory:` an `InMemorySaver` and an `InMemoryStore` (gone with the process);
        * `sqlite:PATH` LangGraph's `AsyncSqliteSaver` and `AsyncSqliteStore` on the file PATH
          (created if missing).

        Raises:
            ValueError: another scheme, or `sqlite:` without a path.
        """
        scheme, sep, rest = url.partition(":")
        async with AsyncExitStack() as stack:
            if scheme == "memory" and sep and not rest:
                store = cls(InMemorySaver(), InMemoryStore(), model=model)
            elif scheme == "sqlite" and rest:
                saver = await stack.enter_async_context(AsyncSqliteSaver.from_conn_string(rest))
                await saver.setup()
                directory = await stack.enter_async_context(AsyncSqliteStore.from_conn_string(rest))
                await directory.setup()
                store = cls(saver, directory, model=model)
            else:
                raise ValueError(
                    f"the LangGraph runtime takes 'memory:' or 'sqlite:PATH', not {url!r}"
                )
            try:
                yield store
            finally:
                await store.aclose()

    # -- what the agent uses besides the SessionStore interface ------------------------------

    async def answer(self, session_id: str, message_id: str) -> AIMessage:
        """Run the graph's model node on the user message `message_id`; return the stored
        answer.

        Raises:
            StorageError: the session does not exist, or the run stored no answer.
        """
        await self._require(session_id)
        async with self._locks[session_id]:
            with _storage_errors():
                result = await self.graph.ainvoke(
                    {"reply_to": message_id}, _config(session_id), durability="exit"
                )
        await self._touch(session_id)
        reply = result["messages"][-1] if result.get("messages") else None
        if not isinstance(reply, AIMessage):
            raise StorageError("the model stored no answer")
        return reply

    def stored_id(self, proposed: str) -> str | None:
        """The id a user message proposed as `proposed` was stored under (once; then forgotten)."""
        return self._assigned.pop(proposed, None)

    async def thread_messages(self, session_id: str) -> list[BaseMessage]:
        """The messages of the session's thread, as stored in the latest checkpoint."""
        values = await self._values(session_id)
        return list(values.get("messages", []))

    # -- sessions ------------------------------------------------------------------------------

    async def create_session(self, record: SessionRecord) -> None:
        self._check_open()
        if await self._sessions.get(record.session_id) is not None:
            raise SessionExists(record.session_id)
        await self._sessions.put(record.session_id, _value_of(record))

    async def get_session(self, session_id: str) -> SessionRecord | None:
        self._check_open()
        item = await self._sessions.get(session_id)
        return None if item is None else _record_of(session_id, item.value)

    async def list_sessions(
        self,
        *,
        cwd: str | None = None,
        cursor: str | None = None,
        limit: int = 100,
        tenant: str | AnyTenant | None = ANY_TENANT,
    ) -> tuple[list[SessionRecord], str | None]:
        self._check_open()
        check_limit(limit)
        after = decode_cursor(cursor) if cursor is not None else None
        records: list[SessionRecord] = []
        offset = 0
        while True:  # LangGraph's store pages by offset and sorts by none of our fields
            items = await self._sessions.search(
                filter={"cwd": cwd} if cwd is not None else None, offset=offset
            )
            records.extend(_record_of(item.key, item.value) for item in items)
            if len(items) < _PAGE:
                break
            offset += len(items)
        if not isinstance(tenant, AnyTenant):
            records = [r for r in records if r.tenant == tenant]
        records.sort(key=lambda r: (-r.updated_at, r.session_id))
        if after is not None:
            position = (-after[0], after[1])
            records = [r for r in records if (-r.updated_at, r.session_id) > position]
        page = records[:limit]
        more = len(records) > limit
        return page, encode_cursor(page[-1].updated_at, page[-1].session_id) if more else None

    async def delete_session(self, session_id: str) -> bool:
        self._check_open()
        async with self._locks[session_id]:
            existed = await self._sessions.get(session_id) is not None
            await self._sessions.put(session_id, None)
            with _storage_errors():
                await self.checkpointer.adelete_thread(session_id)
        self.keys.forget_session(session_id)
        return existed

    async def update_session(
        self,
        session_id: str,
        *,
        title: str | Unchanged | None = UNCHANGED,
        updated_at: float | Unchanged = UNCHANGED,
    ) -> SessionRecord:
        self._check_open()
        item = await self._sessions.get(session_id)
        if item is None:
            raise SessionMissing(session_id)
        value = dict(item.value)
        if not isinstance(title, Unchanged):
            value["title"] = title
        if not isinstance(updated_at, Unchanged):
            value["updated_at"] = updated_at
        await self._sessions.put(session_id, value)
        return _record_of(session_id, value)

    async def fork_session(self, source_id: str, new_record: SessionRecord) -> None:
        self._check_open()
        await self._require(source_id)
        if await self._sessions.get(new_record.session_id) is not None:
            raise SessionExists(new_record.session_id)
        values = await self._values(source_id)
        copy: dict[str, Any] = {
            "messages": list(values.get("messages", [])),
            "events": list(values.get("events", [])),
        }
        async with self._locks[new_record.session_id]:
            # The copied messages keep their ids: ids derived in the source never match the
            # ids derived for the fork's own session id, so its keys start unused (R32).
            if copy["messages"] or copy["events"]:
                with _storage_errors():
                    await self.graph.aupdate_state(
                        _config(new_record.session_id), copy, as_node="record"
                    )
        await self._sessions.put(new_record.session_id, _value_of(new_record))

    # -- messages and keys -------------------------------------------------------------------

    async def insert_user_message(
        self,
        session_id: str,
        *,
        message_id: str,
        update: bytes,
        idempotency_key: str | None,
        prompt_digest: bytes | None,
    ) -> InsertOutcome:
        """Store the user message in the thread at most once per key (see `AdapterKeys.submit`).

        The message is stored under the derived id (keyed) or a random UUID, not `message_id`:
        `stored_id(message_id)` tells which. A recorded key comes back with no digest.
        """
        await self._require(session_id)
        content = orjson.loads(update).get("content") or []
        submitted: list[str] = []

        async def submit(stored_id: str) -> None:
            async with self._locks[session_id]:
                message = HumanMessage(id=stored_id, content=content)
                with _storage_errors():
                    await self.graph.aupdate_state(
                        _config(session_id), {"messages": [message]}, as_node="respond"
                    )
            submitted.append(stored_id)

        # Shielded (bounded): a caller cancelled while the thread is written must still learn
        # that it was (`SessionStore.insert_user_message`), or the turn would never run.
        with anyio.move_on_after(_INSERT_TIMEOUT, shield=True) as scope:
            stored = await self.keys.submit(
                session_id, idempotency_key, submit, load_history_ids=self._history_ids
            )
            if not submitted:
                return InsertOutcome(message_id=stored, inserted=False, prompt_digest=None)
            self._assigned[message_id] = stored
            await self._touch(session_id)
            return InsertOutcome(message_id=stored, inserted=True, prompt_digest=prompt_digest)
        assert scope.cancelled_caught
        raise StorageError(
            f"storing a user message in the thread took over {_INSERT_TIMEOUT:.0f} s"
            " (it may or may not have been stored)"
        )

    async def find_key(self, session_id: str, key: str) -> KeyRecord | None:
        self._check_open()
        if await self._sessions.get(session_id) is None:
            return None
        found = await self.keys.lookup(session_id, key, load_history_ids=self._history_ids)
        return None if found is None else KeyRecord(message_id=found, prompt_digest=None)

    async def count_user_messages(
        self, session_id: str, *, idempotency_key: str | None = None
    ) -> int:
        messages = [m for m in await self.thread_messages(session_id) if m.type == "human"]
        if idempotency_key is None:
            return len(messages)
        wanted = derive_message_id(session_id, idempotency_key)
        return sum(1 for m in messages if m.id == wanted)

    # -- the timeline --------------------------------------------------------------------------

    async def append_update(
        self, session_id: str, update: bytes, *, message_id: str | None = None
    ) -> int:
        await self._require(session_id)
        decoded = orjson.loads(update)
        if decoded.get("sessionUpdate") == "agent_message" and message_id is not None:
            # an agent message is conversation: a LangChain message of the thread
            reply = AIMessage(id=message_id, content=_text(decoded.get("content") or []))
            run: ThreadState = {"messages": [reply]}
        else:
            run = {"event": {"update": decoded, "messageId": message_id}}
        async with self._locks[session_id]:
            with _storage_errors():
                values: dict[str, Any] = await self.graph.ainvoke(
                    run, _config(session_id), durability="exit"
                )
        await self._touch(session_id)
        return _count(values)

    async def read_timeline(
        self, session_id: str, *, after_seq: int = 0, limit: int = 1000
    ) -> list[TimelineEntry]:
        check_limit(limit)
        self._check_open()
        async with self._locks[session_id]:
            values = await self._values_locked(session_id)
            if after_seq == 0 and await self._sessions.get(session_id) is not None:
                # a replay from the start reads every stored user message: fill the key cache
                # (under the thread lock, so no submit can slip between the read and the note)
                self.keys.note_history(session_id, _user_ids(values))
        return [e for e in _timeline(session_id, values) if e.seq > after_seq][:limit]

    async def read_timeline_tail(self, session_id: str, *, limit: int = 1) -> list[TimelineEntry]:
        check_limit(limit)
        values = await self._values(session_id)
        return _timeline(session_id, values)[-limit:]

    async def aclose(self) -> None:
        self._closed = True

    # -- helpers -------------------------------------------------------------------------------

    async def _history_ids(self, session_id: str) -> list[str]:
        """The kit's history read: every user-message id stored in the thread."""
        self.history_reads[session_id] += 1
        return _user_ids(await self._values(session_id))

    async def _values(self, session_id: str) -> dict[str, Any]:
        self._check_open()
        async with self._locks[session_id]:
            return await self._values_locked(session_id)

    async def _values_locked(self, session_id: str) -> dict[str, Any]:
        # the latest checkpoint only: cheaper than `graph.aget_state`, which also works out
        # the next tasks
        with _storage_errors():
            found = await self.checkpointer.aget_tuple(_config(session_id))
        if found is None:
            return {}
        return dict(found.checkpoint["channel_values"])

    async def _require(self, session_id: str) -> None:
        self._check_open()
        if await self._sessions.get(session_id) is None:
            raise SessionMissing(session_id)

    async def _touch(self, session_id: str) -> None:
        item = await self._sessions.get(session_id)
        if item is not None:
            value = dict(item.value)
            value["updated_at"] = max(time.time(), float(value["updated_at"]))
            await self._sessions.put(session_id, value)

    def _check_open(self) -> None:
        if self._closed:
            raise StorageError("the LangGraph store is closed")


def _user_ids(values: dict[str, Any]) -> list[str]:
    return [m.id for m in values.get("messages", []) if m.type == "human" and m.id is not None]


def _count(values: dict[str, Any]) -> int:
    """How many timeline entries the state holds (the seq of the last one)."""
    kinds = ("human", "ai")
    return sum(1 for m in values.get("messages", []) if m.type in kinds) + len(
        values.get("events", [])
    )


def _timeline(session_id: str, values: dict[str, Any]) -> list[TimelineEntry]:
    """The session's retained updates in order: messages, with each event placed after the
    messages that were stored before it."""
    messages: Sequence[BaseMessage] = values.get("messages", [])
    events: Sequence[dict[str, Any]] = values.get("events", [])
    entries: list[TimelineEntry] = []

    def add(update: dict[str, Any], message_id: str | None) -> None:
        seq = len(entries) + 1
        entries.append(TimelineEntry(session_id, seq, message_id, orjson.dumps(update)))

    pending = iter(events)
    event = next(pending, None)
    for index, message in enumerate(messages):
        while event is not None and event["at"] <= index:
            add(event["update"], event.get("messageId"))
            event = next(pending, None)
        if message.type == "human":
            kind, content = "user_message", message.content
        elif message.type == "ai":
            kind, content = "agent_message", [{"type": "text", "text": _text(message.content)}]
        else:
            continue
        add({"sessionUpdate": kind, "messageId": message.id, "content": content}, message.id)
    while event is not None:
        add(event["update"], event.get("messageId"))
        event = next(pending, None)
    return entries


class LangGraphAgent(ReferenceAgent):
    """The reference agent's scripted turn over a `LangGraphStore`, answered by the graph's
    model node (see the module docstring)."""

    def __init__(
        self,
        store: LangGraphStore,
        *,
        side_effects: Path,
        policy: HeldPolicy = "hold",
        compare_prompts: bool = True,
        resume_interrupted: bool = False,
    ) -> None:
        super().__init__(
            store,
            side_effects=side_effects,
            policy=policy,
            compare_prompts=compare_prompts,
            resume_interrupted=resume_interrupted,
        )
        self.info = {"name": "acp-once-langgraph", "version": self.info["version"]}
        self.threads = store

    async def run_turn(self, turn: Turn, emit: TurnContext) -> StopReason | Extension:
        if turn.live_only:  # a locally handled command never reaches the graph
            return await super().run_turn(turn, emit)
        text = turn.text
        if "[tool]" in text:
            tool_id = f"tool_{uuid.uuid4().hex}"
            await emit.emit(
                {
                    "sessionUpdate": "tool_call_update",
                    "toolCallId": tool_id,
                    "title": "append to the side-effect log",
                    "kind": "edit",
                    "status": "in_progress",
                }
            )
            await anyio.to_thread.run_sync(self._side_effect, turn.session_id, turn.message_id)
            await emit.emit(
                {"sessionUpdate": "tool_call_update", "toolCallId": tool_id, "status": "completed"}
            )
        work = _work_seconds(text)
        if work:
            await anyio.sleep(work)
        reply = await self.threads.answer(turn.session_id, turn.message_id)
        # stored by the graph already: sent live, not retained a second time
        await emit.emit(
            {
                "sessionUpdate": "agent_message",
                "messageId": reply.id,
                "content": [{"type": "text", "text": _text(reply.content)}],
            },
            retain=False,
        )
        return "end_turn"

    async def _broadcast(self, session: Any, update: dict[str, Any]) -> None:
        # The runtime announces a new user message under the id it proposed; the thread stored
        # it under the derived (or a random) id, which is the one the prompt was answered with.
        if update.get("sessionUpdate") == "user_message":
            stored = self.threads.stored_id(str(update.get("messageId")))
            if stored is not None:
                update = {**update, "messageId": stored}
        await super()._broadcast(session, update)


def _work_seconds(text: str) -> float:
    found = _WORK.search(text)
    return float(found.group(1)) if found else 0.0
