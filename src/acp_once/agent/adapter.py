"""`AdapterKeys`: idempotency keys for adapters whose runtime owns the session store.

An adapter (claude-agent-acp over Claude Code, codex-acp over Codex) cannot write the key and the
message in one step of its own: the runtime stores the session. Both runtimes do store an id that
the adapter chooses with each user message, so the adapter derives that id from the key (RFD
"Adapter validation", R41 and D14) and the runtime writes key and message in one step:

    keys = AdapterKeys()                                   # one per agent, all sessions

    async def prompt(self, params, ctx):
        async def submit(message_id: str) -> None:        # the runtime stores this id
            await sdk.send_user_message(params.session_id, params.prompt, uuid=message_id)

        async def history_ids(session_id: str) -> list[str]:
            return [m.uuid for m in await sdk.user_messages(session_id)]

        message_id = await keys.submit(
            params.session_id, params.idempotency_key, submit, load_history_ids=history_ids
        )
        return PromptResponse(message_id=message_id)

With a key, the message id is `derive_message_id(session_id, key)` and, before submitting,
`submit` checks:

1. its pending prompts: a second request for a pending key waits for the first and gets the same
   outcome, success or error (R20), so concurrent requests with one new key submit once (R24);
   an error leaves the key unused (R22);
2. a per-session cache of the session's user-message ids. The cache is filled once per session
   per process from `load_history_ids` (the runtime's stored history), on the first keyed prompt
   after a restart, and each submitted id is added to it. A derived id found there is answered
   at once and the runtime is not called (R19). A replay the Client asked for can fill the cache
   instead (`note_history`). The stored session stays the record; the cache only saves reads.

Without a key the id is a fresh random UUID and nothing is looked up. Locally handled commands,
which never reach the runtime (`/status`, `/remote-control`), go through `submit_live`: their
keys are kept in memory only while the session is active (R36, `session_inactive`), since running
such a command again after a restart does no harm.

When this is enough, and where it is weaker than a store of our own (`SessionAgent`,
`PromptKeys`):

- It is enough when the runtime stores the adapter's id with every user message, including
  prompts taken in mid-turn, and returns it with the history after a restart (both runtimes
  in the RFD's table do).
- A runtime may re-run a message after a restart. The RFD reports that Claude Code runs a
  prompt that was taken in mid-turn again after a restart. The key still inserts at most once
  (the retry is answered from the history and not submitted), but the runtime's own replay of
  the work is out of the adapter's hands.
- There is no stored prompt to compare a reused key with: the runtime stores the prompt in its
  own form. A key reused with a different prompt is answered as a retry (the original id, nothing
  inserted); the RFD allows this, an agent with its own store may refuse it with -32602.
- Filling the cache costs one read of the session's history per session per process, about the
  work of a replay. Long histories make the first keyed prompt after a restart slower; every
  later keyed prompt of the session is a set lookup. The cache holds one id per user message
  until `forget_session`.
- A derived id is a hash of the key, and the id is visible to every Client of the session (it
  is the `messageId`). That is acceptable because a key is not a credential, but a store of your
  own can keep the key private in a field of its own (D14).
- A submit cut short by cancellation leaves the outcome unknown (the runtime may have stored the
  id), so the session's cache is dropped and the next keyed prompt reads the history again.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Iterable

from acp_once.agent.state import KeyJoin, Outcome

__all__ = ["MESSAGE_ID_NAMESPACE", "AdapterKeys", "derive_message_id"]

MESSAGE_ID_NAMESPACE = uuid.UUID("eda141f6-2563-575d-954d-b3dc5bc89364")
"""The UUIDv5 namespace of derived message ids: `uuid5(NAMESPACE_URL,
"urn:acp-once:adapter-message-id")`. Fixed forever: changing it would change every derived id,
and keys recorded before the change would no longer be found in the stored history."""

SubmitToRuntime = Callable[[str], Awaitable[None]]
LoadHistoryIds = Callable[[str], Awaitable[Iterable[str]]]
RunLive = Callable[[str], Awaitable[None]]


def derive_message_id(session_id: str, key: str) -> str:
    """The message id of a keyed prompt: UUIDv5 over (session id, key) in `MESSAGE_ID_NAMESPACE`.

    The name is `f"{session_id}\\0{key}"`; a session id may not contain NUL, so the split is
    unambiguous. The session id is part of it, so a fork (a new session id) gets different ids
    for the same keys (R32). Keys are case-sensitive and hashed as given.

    Raises:
        ValueError: on an empty key (there is no id to derive without a key: use a random one)
            or a session id containing NUL.
    """
    if not key:
        raise ValueError("derive_message_id needs a key; a prompt without one gets a random id")
    if "\0" in session_id:
        raise ValueError("a session id containing NUL cannot be part of a derived message id")
    return str(uuid.uuid5(MESSAGE_ID_NAMESPACE, f"{session_id}\0{key}"))


class _Loading(Outcome):
    """A history load in progress, with the ids submitted while it reads."""

    def __init__(self) -> None:
        super().__init__()
        self.added: set[str] = set()


class AdapterKeys:
    """Per-agent key lookup for an adapter. One instance serves every session.

    Memory holds, per session: the user-message ids read from the runtime's history (a cache,
    filled once per process), and the keys of locally handled commands (while the session is
    active). Nothing is written anywhere else: the runtime's stored session is the record.
    Pending submits are joined by `KeyJoin`, the same core as `SessionAgent`'s.
    """

    def __init__(self) -> None:
        self._history: dict[str, set[str]] = {}
        self._loading: dict[str, _Loading] = {}
        self._pending: KeyJoin[tuple[str, str], Outcome] = KeyJoin()
        self._live: dict[tuple[str, str], str] = {}

    async def submit(
        self,
        session_id: str,
        key: str | None,
        submit_to_runtime: SubmitToRuntime,
        *,
        load_history_ids: LoadHistoryIds,
    ) -> str:
        """Submit a prompt at most once per (session, key) and return its message id.

        Args:
            session_id: the ACP session id (also the runtime's, or mapped to it by the caller).
            key: the prompt's `idempotencyKey`, or None.
            submit_to_runtime: sends the prompt to the runtime with the given message id (the
                SDK message `uuid`, Codex's `clientUserMessageId`). Returning means the runtime
                took it; raising means it did not, and the key stays unused.
            load_history_ids: `session_id -> ids of the session's stored user messages`, read
                from the runtime (all of them, including prompts taken in mid-turn). Called at
                most once per session per process, on the first keyed prompt that needs it.

        Raises:
            Exception: whatever `submit_to_runtime` raised, to this request and to every request
                for the same key that waited on it; or whatever `load_history_ids` raised (the
                cache stays empty and the next keyed prompt loads again).
        """
        if key is None:
            message_id = str(uuid.uuid4())
            await submit_to_runtime(message_id)
            self._add_if_cached(session_id, message_id)
            return message_id
        message_id = derive_message_id(session_id, key)
        slot = (session_id, key)
        while True:
            pending = self._pending.get(slot)
            if pending is None:
                ids = await self._history_ids(session_id, load_history_ids)
                if message_id in ids:
                    return message_id  # stored already: a retry, answered without the runtime
                pending = self._pending.get(slot)  # another request may have started meanwhile
            if pending is None:
                break
            await pending.done.wait()
            if pending.message_id is not None:
                return pending.message_id
            if isinstance(pending.error, Exception):
                raise pending.error
            # the first request was cancelled mid-submit: look again (its cache was dropped)

        async def submit() -> str:
            await submit_to_runtime(message_id)
            return message_id

        try:
            await self._pending.run(slot, Outcome(), submit)
        except Exception:
            raise
        except BaseException:
            # Cancelled: the runtime may or may not have stored the id. Read the history again.
            self._history.pop(session_id, None)
            raise
        self._add_if_cached(session_id, message_id)
        return message_id

    async def submit_live(self, session_id: str, key: str | None, run: RunLive) -> str:
        """Run a locally handled command (never stored by the runtime) at most once per key.

        The key is remembered with a fresh message id in memory, until `session_inactive`.
        Concurrent requests with one key share one run and its outcome; an error leaves the key
        unused. `run` gets the message id.
        """
        if key is None:
            message_id = str(uuid.uuid4())
            await run(message_id)
            return message_id
        slot = (session_id, key)
        while True:
            recorded = self._live.get(slot)
            if recorded is not None:
                return recorded
            pending = self._pending.get(slot)
            if pending is None:
                break
            await pending.done.wait()
            if pending.message_id is not None:
                return pending.message_id
            if isinstance(pending.error, Exception):
                raise pending.error
        message_id = str(uuid.uuid4())

        async def run_it() -> str:
            await run(message_id)
            return message_id

        await self._pending.run(slot, Outcome(), run_it)
        self._live[slot] = message_id
        return message_id

    async def lookup(
        self, session_id: str, key: str, *, load_history_ids: LoadHistoryIds
    ) -> str | None:
        """The derived message id of `key` if the runtime has stored it, else None.

        The same cache as `submit` (filled once per session per process from
        `load_history_ids`); nothing is submitted. For an adapter that must answer "was this key
        used?" before deciding to submit (e.g. a prompt that would be held behind a turn).

        Raises:
            ValueError: on an empty key (see `derive_message_id`).
            Exception: whatever `load_history_ids` raised (the cache stays empty).
        """
        message_id = derive_message_id(session_id, key)
        ids = await self._history_ids(session_id, load_history_ids)
        return message_id if message_id in ids else None

    def note_history(self, session_id: str, ids: Iterable[str]) -> None:
        """Fill the cache from a read the adapter made anyway (a replay the Client asked for).

        Pass every stored user-message id of the session: the session then counts as loaded,
        and `load_history_ids` is not called for it in this process.
        """
        self._history.setdefault(session_id, set()).update(ids)

    def session_inactive(self, session_id: str) -> None:
        """Forget the live-only keys of a session that is no longer active (closed, or its last
        connection ended). Its history cache stays: the stored session has not changed."""
        for slot in [s for s in self._live if s[0] == session_id]:
            del self._live[slot]

    def forget_session(self, session_id: str) -> None:
        """Drop everything held for a session (after `session/delete`, or to free memory: the
        next keyed prompt reads the history again)."""
        self._history.pop(session_id, None)
        self.session_inactive(session_id)

    async def _history_ids(self, session_id: str, load: LoadHistoryIds) -> set[str]:
        """The session's cached user-message ids, loading them once; concurrent callers share
        one load."""
        while True:
            ids = self._history.get(session_id)
            if ids is not None:
                return ids
            loading = self._loading.get(session_id)
            if loading is None:
                break
            await loading.done.wait()
            if isinstance(loading.error, Exception):
                raise loading.error
            # loaded (the loop returns it), or the loader was cancelled (load again here)
        loading = self._loading[session_id] = _Loading()
        try:
            loaded = await load(session_id)
            ids = self._history.setdefault(session_id, set())  # a note_history may have run
            ids.update(loaded)
            ids.update(loading.added)  # submitted during the read, which may have missed them
            return ids
        except BaseException as exc:
            loading.error = exc
            raise
        finally:
            del self._loading[session_id]
            loading.done.set()

    def _add_if_cached(self, session_id: str, message_id: str) -> None:
        # Only a loaded cache is extended: a partial set would hide the history from the lookup.
        ids = self._history.get(session_id)
        if ids is not None:
            ids.add(message_id)
        elif (loading := self._loading.get(session_id)) is not None:
            loading.added.add(message_id)
