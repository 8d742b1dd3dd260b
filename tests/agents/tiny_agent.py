"""A tiny agent written with acp-once, for the stdio subprocess tests.

Its prompt handler reads the first text block:
- "permission": asks the client for permission first, and echoes the chosen option;
- "wait": never finishes on its own (cancel it);
- "die": the process exits at once, with the request unanswered;
- "big:N": sends an agent_message of N bytes before answering;
- anything else: echoed as an agent_message.
A `_echo` extension request returns its params unchanged.
"""

from __future__ import annotations

import os
import sys
import uuid
from typing import Any

import anyio

from acp_once.agent import Agent, CallContext, serve_stdio
from acp_once.protocol import schema as s
from acp_once.protocol.initialization import PROTOCOL_VERSION, negotiate_version


class TinyAgent(Agent):
    async def initialize(
        self, params: s.InitializeRequest, ctx: CallContext
    ) -> s.InitializeResponse:
        version = negotiate_version(params.protocol_version, [PROTOCOL_VERSION])
        return s.InitializeResponse.model_validate(
            {
                "protocolVersion": version,
                "info": {"name": "tiny-agent", "version": "0.0.1"},
                "capabilities": {"session": {}},
            }
        )

    async def new_session(
        self, params: s.NewSessionRequest, ctx: CallContext
    ) -> s.NewSessionResponse:
        return s.NewSessionResponse(session_id=f"sess_{uuid.uuid4().hex}")

    async def prompt(self, params: s.PromptRequest, ctx: CallContext) -> s.PromptResponse:
        first = params.prompt[0]
        text = first.text if isinstance(first, s.ContentBlockText) else ""
        reply = text
        if text == "die":
            os._exit(3)
        if text == "wait":
            await anyio.sleep_forever()
        if text == "permission":
            answer = await ctx.client.request_permission(
                s.RequestPermissionRequest.model_validate(
                    {
                        "sessionId": params.session_id,
                        "title": "Run the tests?",
                        "options": [
                            {"optionId": "yes", "name": "Yes", "kind": "allow_once"},
                            {"optionId": "no", "name": "No", "kind": "reject_once"},
                        ],
                    }
                )
            )
            outcome = answer.outcome
            reply = f"permission:{getattr(outcome, 'option_id', 'cancelled')}"
        if text.startswith("big:"):
            reply = "x" * int(text[4:])
        message_id = f"msg_{uuid.uuid4().hex}"
        await ctx.client.session_update(
            {
                "sessionId": params.session_id,
                "update": {
                    "sessionUpdate": "agent_message",
                    "messageId": f"agent_{message_id}",
                    "content": [{"type": "text", "text": reply}],
                },
            }
        )
        return s.PromptResponse(message_id=message_id)

    async def ext_method(self, method: str, params: dict[str, Any] | None, ctx: CallContext) -> Any:
        if method == "_echo":
            return params
        return await super().ext_method(method, params, ctx)


def main() -> None:
    max_frame = int(sys.argv[1]) if len(sys.argv) > 1 else 64 * 1024 * 1024
    anyio.run(lambda: serve_stdio(TinyAgent(), max_frame=max_frame))


if __name__ == "__main__":
    main()
