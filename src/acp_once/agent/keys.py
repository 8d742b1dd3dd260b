"""`PromptKeys`: the RFD's key table for agents that keep sessions in their own storage.

`SessionAgent` does all of this for you. If you write an `Agent` directly, over storage you own,
wrap your insertion in `PromptKeys.submit` and the key rules hold (R18-R24, docs/rules.md):

    keys = PromptKeys(lookup=store.message_id_for_key)   # your persistent lookup, or None

    async def prompt(self, params, ctx):
        async def insert() -> str:                        # store the message WITH its key
            return await store.insert(params.session_id, params.prompt, params.idempotency_key)
        message_id = await keys.submit(params.session_id, params.idempotency_key, insert)
        return PromptResponse(message_id=message_id)

- a key already recorded answers its message id and calls nothing (R19);
- a key whose first request is still pending waits for it and gets the same outcome, success or
  error (R20), so concurrent requests with one new key insert once (R24);
- an error leaves the key unused (R22): `insert` raised, nothing is recorded.

`insert` must write the key in the same step as the message (R38), so that `lookup` finds it
after a restart. Keys are kept in memory only as a cache of recent answers; the lookup is the
record.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Awaitable, Callable

from acp_once.agent.state import KeyJoin, Outcome

__all__ = ["PromptKeys"]

Lookup = Callable[[str, str], Awaitable[str | None]]


class PromptKeys:
    """Per-agent key table. One instance serves every session (keys are scoped per session).

    The pending requests are joined by `KeyJoin`, the same core as `SessionAgent`'s (one
    implementation of the key rules); recorded keys are a cache of recent answers.

    Args:
        lookup: `(session_id, key) -> message id or None`, reading your stored messages (an
            index lookup, not a scan). Without it, keys are remembered only in memory.
        cache_size: how many recorded keys to keep in memory.
    """

    def __init__(self, *, lookup: Lookup | None = None, cache_size: int = 10_000) -> None:
        self._lookup = lookup
        self._cache_size = cache_size
        self._recorded: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._pending: KeyJoin[tuple[str, str], Outcome] = KeyJoin()

    async def submit(
        self, session_id: str, key: str | None, insert: Callable[[], Awaitable[str]]
    ) -> str:
        """Insert at most once per (session, key) and return the message id.

        Raises:
            Exception: whatever `insert` raised, to this request and to every request for the
                same key that waited on it; the key stays unused.
        """
        if key is None:
            return await insert()
        slot = (session_id, key)
        recorded = self._recorded.get(slot)
        if recorded is not None:
            self._recorded.move_to_end(slot)
            return recorded
        pending = self._pending.get(slot)
        if pending is None and self._lookup is not None:
            found = await self._lookup(session_id, key)
            if found is not None:
                self._remember(slot, found)
                return found
            pending = self._pending.get(slot)  # another request may have started meanwhile
        if pending is not None:
            return await pending.result()
        message_id = await self._pending.run(slot, Outcome(), insert)
        self._remember(slot, message_id)
        return message_id

    def forget_session(self, session_id: str) -> None:
        """Drop the cached keys of a session (after `session/delete`)."""
        for slot in [s for s in self._recorded if s[0] == session_id]:
            del self._recorded[slot]

    def _remember(self, slot: tuple[str, str], message_id: str) -> None:
        self._recorded[slot] = message_id
        self._recorded.move_to_end(slot)
        while len(self._recorded) > self._cache_size:
            self._recorded.popitem(last=False)
