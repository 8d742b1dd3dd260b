"""What crosses between the v2 face and the v1 child, as data: pure functions, no I/O.

- `StoredV1ToV2Updates` turns the child's v1 `session/update`s of one session into v2
  updates, each with what the runtime does with it (`Out.mode`). The translation itself is the
  one the client uses for a v1 agent (`acp_once.protocol.v1_to_v2.V1ToV2Updates`: message ids
  for v1's id-less chunks, tool calls, plans); this adds what to store. Chunks are sent live,
  and each message is stored whole once it ends (a tool call, a plan, a permission request or
  the end of the turn ends the messages in progress), so a replay shows what was streamed, in
  the same order: as one update, or, when its text is over `STORED_PART_BYTES`, as chunks of
  at most that much under its id, so that no replayed frame nears the frame limit. A message's
  text is gathered in one buffer: linear time and memory, however many chunks it came in.
  Tool calls and plans are sent and stored; the other kinds are live only. A v1 update that
  has no v2 counterpart (`current_mode_update`, the child's echo of the user's message, a kind
  v2 does not know) is dropped.
- `prompt_to_v1`, `permission_to_v2`, `permission_to_v1`: the prompt's content blocks
  (the same shapes in both versions), and a permission request and its answer. The stop
  reason of the child's answer is `acp_once.protocol.v1_to_v2.v2_stop_reason_from_v1`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import ValidationError

from acp_once.agent.state import new_id
from acp_once.agent.updates import check_update
from acp_once.protocol import schema as s
from acp_once.protocol.v1_to_v2 import V1ToV2Updates

__all__ = [
    "CLIENT_CAPABILITIES",
    "STORED_PART_BYTES",
    "Out",
    "StoredV1ToV2Updates",
    "permission_to_v1",
    "permission_to_v2",
    "prompt_to_v1",
]

CLIENT_CAPABILITIES: dict[str, Any] = {
    "fs": {"readTextFile": False, "writeTextFile": False},
    "terminal": False,
}
"""What the child is told the client can do: nothing beyond the protocol itself. v2 has no
file system or terminal methods to forward them to, so the child uses its own."""

# v2 chunk kind -> the whole-message kind stored when the message ends, and back
_WHOLE = {"agent_message_chunk": "agent_message", "agent_thought_chunk": "agent_thought"}
_CHUNK_OF = {whole: chunk for chunk, whole in _WHOLE.items()}
_PLAIN_TEXT = frozenset({"type", "text"})

STORED_PART_BYTES = 1024 * 1024
"""The most text (UTF-8 bytes) one stored update of a message holds: a longer message is
stored as several chunks under its id. JSON escaping at most sextuples it (a control character
is written `\\u001f`), so a replayed update stays far below the 64 MiB frame limit."""
_TOOL_FIELDS = ("title", "kind", "status", "content", "locations", "rawInput", "rawOutput")
_RETAINED = frozenset({"tool_call_update", "plan_update"})
# the child's echo of the user's message (the store has it already) and v1 modes (v2 has none)
_DROPPED = frozenset({"user_message_chunk", "current_mode_update"})

Mode = Literal["live", "retain", "store"]


@dataclass(frozen=True, slots=True)
class Out:
    """One v2 update and what to do with it: `live` sent only, `retain` stored and sent,
    `store` stored only (a whole message whose chunks were sent already)."""

    update: dict[str, Any]
    mode: Mode


@dataclass(slots=True)
class _Message:
    """A message in progress: its finished blocks, and the text run being streamed, as UTF-8
    in one growing buffer (appending to a `str` would copy the whole run at every chunk)."""

    whole_kind: str
    blocks: list[dict[str, Any]] = field(default_factory=list)
    text: bytearray | None = None

    def append(self, block: dict[str, Any]) -> None:
        """Add a chunk's block: adjacent plain text joins into one text block."""
        text = block.get("text")
        if block.get("type") == "text" and isinstance(text, str) and set(block) <= _PLAIN_TEXT:
            if self.text is None:
                self.text = bytearray()
            self.text += text.encode("utf-8", "surrogatepass")
            return
        self._close_text()
        self.blocks.append(dict(block))

    def _close_text(self) -> None:
        if self.text is not None:
            self.blocks.append({"type": "text", "text": _decode(self.text)})
            self.text = None

    def stored(self, message_id: str) -> list[dict[str, Any]]:
        """The updates that store it: one whole message, or, when its text is longer than
        `STORED_PART_BYTES`, its blocks as chunks of at most that much text each, under its
        id, so that no stored update (replayed as one frame) nears the frame limit."""
        run = self.text
        if run is None or len(run) <= STORED_PART_BYTES:
            self._close_text()
            whole = {"sessionUpdate": self.whole_kind, "messageId": message_id}
            return [{**whole, "content": self.blocks}] if self.blocks else []
        chunk_kind = _CHUNK_OF[self.whole_kind]
        blocks: list[dict[str, Any]] = list(self.blocks)
        self.text = None
        start = 0
        while start < len(run):
            end = min(start + STORED_PART_BYTES, len(run))
            while end < len(run) and run[end] & 0xC0 == 0x80:  # not inside a character
                end -= 1
            blocks.append({"type": "text", "text": _decode(run[start:end])})
            start = end
        return [
            {"sessionUpdate": chunk_kind, "messageId": message_id, "content": block}
            for block in blocks
        ]


def _decode(data: bytes | bytearray) -> str:
    return data.decode("utf-8", "surrogatepass")


class StoredV1ToV2Updates:
    """The v1 updates of one session, as v2 updates to send and store (see the module
    docstring).

    Args:
        plan_id: the id of the session's one v2 plan (a v1 `plan` replaces the whole plan).
    """

    def __init__(self, plan_id: str) -> None:
        self.dropped = 0
        """v1 updates that had no valid v2 counterpart."""
        self._updates = V1ToV2Updates("", new_id=lambda: new_id("msg_agent"), plan_id=plan_id)
        self._open: dict[str, _Message] = {}  # message id -> streamed so far, in start order

    @property
    def streaming(self) -> bool:
        """Whether a message is in progress (its chunks sent, the whole not yet stored)."""
        return bool(self._open)

    @property
    def plan_id(self) -> str:
        return self._updates.plan_id

    def translate(self, update: Any) -> list[Out]:
        """The v2 updates for the v1 `update` (a wire dict), in order; [] when it has none."""
        kind = update.get("sessionUpdate") if isinstance(update, dict) else None
        if kind in _DROPPED:
            return []
        try:
            translated = self._updates.translate(update) if isinstance(kind, str) else []
        except ValidationError:
            translated = []
        wire = [
            n.update.model_dump(by_alias=True, exclude_unset=True, exclude_none=True, mode="json")
            for n in translated
            if not isinstance(n.update, s.SessionUpdateOther)
        ]
        if not wire:
            self.dropped += 1
            return []
        out: list[Out] = []
        for v2 in wire:
            whole_kind = _WHOLE.get(v2["sessionUpdate"])
            if whole_kind is not None:
                message = self._open.setdefault(v2["messageId"], _Message(whole_kind))
                if isinstance(v2.get("content"), dict):
                    message.append(v2["content"])
                out.append(Out(v2, "live"))
            elif v2["sessionUpdate"] in _RETAINED:
                # the messages streamed so far are stored before what ends them
                out.extend(self.finish())
                out.append(Out(v2, "retain"))
            else:
                out.append(Out(v2, "live"))
        return out  # valid v2: the translation validated each one

    def finish(self) -> list[Out]:
        """The whole messages in progress, to store, in the order they started (none: []);
        the child's next chunks start new messages."""
        opened, self._open = self._open, {}
        self._updates.end_messages()
        wholes = [
            Out(update, "store")
            for message_id, m in opened.items()
            for update in m.stored(message_id)
        ]
        return self._valid(wholes)

    def announce_permission(self, params: dict[str, Any]) -> list[Out]:
        """What goes before a v1 permission request (`params`) is forwarded: the messages in
        progress, stored, and the tool call it is about, announced live (it may not have been
        reported before)."""
        announce = permission_tool_call(params)
        return self.finish() + self._valid([Out(announce, "live")] if announce else [])

    def _valid(self, outs: Iterable[Out]) -> list[Out]:
        """Keep what v2 accepts: a child's malformed update is dropped, never forwarded."""
        kept: list[Out] = []
        for out in outs:
            try:
                check_update(out.update)
            except ValueError:
                self.dropped += 1
                continue
            kept.append(out)
        return kept


def _tool_call_update(update: dict[str, Any]) -> dict[str, Any] | None:
    tool_call_id = update.get("toolCallId")
    if not isinstance(tool_call_id, str):
        return None
    out: dict[str, Any] = {"sessionUpdate": "tool_call_update", "toolCallId": tool_call_id}
    for name in _TOOL_FIELDS:
        value = update.get(name)
        if value is not None:
            out[name] = value
    return out


def _without_nulls(update: dict[str, Any]) -> dict[str, Any]:
    return {name: value for name, value in update.items() if value is not None}


def prompt_to_v1(blocks: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """A v2 prompt's content blocks (wire dicts) for the child's v1 `session/prompt`: text,
    image, audio, resource links and embedded resources have the same shapes in v1."""
    return [dict(block) for block in blocks]


def permission_to_v2(params: dict[str, Any], session_id: str) -> dict[str, Any]:
    """The v2 `session/request_permission` params for the child's v1 request `params`, in the
    v2 session `session_id`: the tool call's title becomes the request's title, the tool call
    its subject.

    Raises:
        ValueError: `params` has no options or no tool call id.
    """
    tool = params.get("toolCall")
    options = params.get("options")
    if not isinstance(tool, dict) or not isinstance(tool.get("toolCallId"), str):
        raise ValueError("the permission request names no tool call")
    if not isinstance(options, list) or not options:
        raise ValueError("the permission request offers no options")
    title = tool.get("title")
    return {
        "sessionId": session_id,
        "title": title if isinstance(title, str) and title else "Permission requested",
        "options": [_without_nulls(o) if isinstance(o, dict) else o for o in options],
        "subject": {"type": "tool_call", "toolCall": {"toolCallId": tool["toolCallId"]}},
    }


def permission_tool_call(params: dict[str, Any]) -> dict[str, Any] | None:
    """The v2 `tool_call_update` announcing the tool call a v1 permission request is about (it
    may not have been reported before), or None."""
    tool = params.get("toolCall")
    return _tool_call_update(tool) if isinstance(tool, dict) else None


def permission_to_v1(answer: dict[str, Any]) -> dict[str, Any]:
    """The v1 answer for the v2 client's `answer` (the outcomes have the same shapes); anything
    but a selected option is `cancelled`."""
    outcome = answer.get("outcome")
    if (
        isinstance(outcome, dict)
        and outcome.get("outcome") == "selected"
        and isinstance(outcome.get("optionId"), str)
    ):
        return {"outcome": {"outcome": "selected", "optionId": outcome["optionId"]}}
    return {"outcome": {"outcome": "cancelled"}}
