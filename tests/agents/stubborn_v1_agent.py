"""A v1 stdio agent that does not stop when asked: stdlib only, for the upgrade runtime's
containment tests and benchmark (`benchmarks/bench_upgrade_kill.py`).

Usage: `python stubborn_v1_agent.py --effects FILE [--session-id ID] [--grandchild]
[--chunks N --chunk-size B]`.

- It ignores the end of its stdin (keeps running, as Zed's codex-acp does) and SIGTERM; only
  SIGKILL stops it.
- `--grandchild` starts a `sleep` of its own at start, which stays in its process group.
- Every `session/prompt` appends `<pid> <session id> <text>` to `--effects` before any work
  (the side effect the tests count), then sends the chunk `working`, then:
  - `[hang]` in the text: never answers;
  - `[chunks]`: sends `--chunks` more chunks of `--chunk-size` bytes each, then answers;
  - `[tool:N]`: a tool call, then N `tool_call_update`s, each with the content so far plus
    one more line (v1's update replaces the content), then answers;
  - otherwise answers `end_turn`.
- `session/new` answers `--session-id` when given (every session the same id), else a new
  one; `session/load` is advertised and accepted for any id.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from typing import Any


def send(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def update(session_id: str, body: dict[str, Any]) -> None:
    send(
        {
            "jsonrpc": "2.0",
            "method": "session/update",
            "params": {"sessionId": session_id, "update": body},
        }
    )


def chunk(session_id: str, text: str) -> None:
    update(
        session_id,
        {"sessionUpdate": "agent_message_chunk", "content": {"type": "text", "text": text}},
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--effects", required=True)
    parser.add_argument("--session-id")
    parser.add_argument("--grandchild", action="store_true")
    parser.add_argument("--chunks", type=int, default=0)
    parser.add_argument("--chunk-size", type=int, default=100)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args.grandchild:
        subprocess.Popen(["sleep", "1000"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    for line in sys.stdin:
        try:
            message = json.loads(line)
        except ValueError:
            continue
        method = message.get("method")
        params = message.get("params") or {}
        rid = message.get("id")
        if method == "initialize":
            send(
                {
                    "jsonrpc": "2.0",
                    "id": rid,
                    "result": {
                        "protocolVersion": 1,
                        "agentCapabilities": {"loadSession": True},
                        "agentInfo": {"name": "stubborn", "version": "1"},
                    },
                }
            )
        elif method == "session/new":
            sid = args.session_id or f"stubborn-{uuid.uuid4().hex[:12]}"
            send({"jsonrpc": "2.0", "id": rid, "result": {"sessionId": sid}})
        elif method == "session/load":
            send({"jsonrpc": "2.0", "id": rid, "result": {}})
        elif method == "session/prompt":
            sid = str(params.get("sessionId"))
            text = " ".join(b.get("text", "") for b in params.get("prompt", []))
            with open(args.effects, "a") as effects:
                effects.write(f"{os.getpid()} {sid} {text}\n")
            chunk(sid, "working")
            if "[hang]" in text:
                continue
            if "[chunks]" in text:
                for _ in range(args.chunks):
                    chunk(sid, "x" * args.chunk_size)
            if "[tool:" in text:
                count = int(text.split("[tool:", 1)[1].split("]", 1)[0])
                update(
                    sid,
                    {
                        "sessionUpdate": "tool_call",
                        "toolCallId": "t1",
                        "title": "run",
                        "status": "in_progress",
                    },
                )
                lines: list[dict[str, Any]] = []
                for n in range(count):
                    lines.append(
                        {"type": "content", "content": {"type": "text", "text": f"line {n}\n"}}
                    )
                    update(
                        sid,
                        {
                            "sessionUpdate": "tool_call_update",
                            "toolCallId": "t1",
                            "content": list(lines),
                        },
                    )
                update(
                    sid,
                    {
                        "sessionUpdate": "tool_call_update",
                        "toolCallId": "t1",
                        "status": "completed",
                    },
                )
            send({"jsonrpc": "2.0", "id": rid, "result": {"stopReason": "end_turn"}})
        elif rid is not None:
            send(
                {
                    "jsonrpc": "2.0",
                    "id": rid,
                    "error": {"code": -32601, "message": "Method not found"},
                }
            )
    while True:  # stdin ended: keep running, as agents that ignore it do
        time.sleep(3600)


if __name__ == "__main__":
    main()
