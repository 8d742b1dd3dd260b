"""A scripted ACP v2 agent over stdio that ends turns the way acp-once agents tag them:
`{"sessionUpdate": "state_update", "state": "idle", "stopReason": R,
"_meta": {"acpOnce": {"messageId": M}}}`. Run: `python tagged_agent.py`.

- `session/new` answers the session "sess_1".
- `session/prompt`: the first prompt is inserted as "msg_A" (its user message, then
  `running`); the second as "msg_B", after which it sends, in this order, the end of B
  ("cancelled") and then the end of A ("end_turn"): a client that pairs ends with turns by
  position ends A with B's reason. A prompt with the key "11111111-1111-4111-8111-111111111111"
  is answered "msg_old" (recorded: nothing is sent).
- `session/resume` with `replayFrom` replays "msg_old" and its tagged end ("end_turn"), then
  its snapshot (idle).
"""

from __future__ import annotations

import json
import sys
from typing import Any

OLD_KEY = "11111111-1111-4111-8111-111111111111"


def send(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def update(update: dict[str, Any]) -> None:
    send(
        {
            "jsonrpc": "2.0",
            "method": "session/update",
            "params": {"sessionId": "sess_1", "update": update},
        }
    )


def user(message_id: str, text: str) -> None:
    update(
        {
            "sessionUpdate": "user_message",
            "messageId": message_id,
            "content": [{"type": "text", "text": text}],
        }
    )


def end(message_id: str, reason: str) -> None:
    update(
        {
            "sessionUpdate": "state_update",
            "state": "idle",
            "stopReason": reason,
            "_meta": {"acpOnce": {"messageId": message_id}},
        }
    )


def main() -> None:
    prompts = 0
    for line in sys.stdin:
        request = json.loads(line)
        method, params, rid = request.get("method"), request.get("params") or {}, request.get("id")
        result: dict[str, Any] = {}
        if method == "initialize":
            result = {
                "protocolVersion": 2,
                "info": {"name": "tagged", "version": "1"},
                "capabilities": {},
                "_meta": {"acpOnce": {"idempotencyKeys": True}},
            }
        elif method == "session/new":
            result = {"sessionId": "sess_1"}
        elif method == "session/resume":
            if params.get("replayFrom") is not None:
                user("msg_old", "old")
                update(
                    {
                        "sessionUpdate": "agent_message",
                        "messageId": "msg_agent_old",
                        "content": [{"type": "text", "text": "done before"}],
                    }
                )
                end("msg_old", "end_turn")
            update({"sessionUpdate": "state_update", "state": "idle"})
        elif method == "session/prompt":
            if params.get("idempotencyKey") == OLD_KEY:
                result = {"messageId": "msg_old"}
            else:
                prompts += 1
                if prompts == 1:
                    user("msg_A", "first")
                    update({"sessionUpdate": "state_update", "state": "running"})
                    result = {"messageId": "msg_A"}
                else:
                    user("msg_B", "second")
                    send({"jsonrpc": "2.0", "id": rid, "result": {"messageId": "msg_B"}})
                    end("msg_B", "cancelled")
                    end("msg_A", "end_turn")
                    continue
        if rid is not None:
            send({"jsonrpc": "2.0", "id": rid, "result": result})


if __name__ == "__main__":
    main()
