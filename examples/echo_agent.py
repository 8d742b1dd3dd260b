"""The bare `Agent` face: `python examples/echo_agent.py` answers three requests on stdin/stdout."""

import uuid

import anyio

from acp_once.agent import Agent, CallContext, serve_stdio
from acp_once.protocol import schema as s


class EchoAgent(Agent):
    async def initialize(
        self, params: s.InitializeRequest, ctx: CallContext
    ) -> s.InitializeResponse:
        info = {
            "protocolVersion": 2,
            "info": {"name": "echo", "version": "1"},
            "capabilities": {"session": {}},
        }
        return s.InitializeResponse.model_validate(info)

    async def new_session(
        self, params: s.NewSessionRequest, ctx: CallContext
    ) -> s.NewSessionResponse:
        return s.NewSessionResponse(session_id=uuid.uuid4().hex)

    async def prompt(self, params: s.PromptRequest, ctx: CallContext) -> s.PromptResponse:
        return s.PromptResponse(message_id=uuid.uuid4().hex)


if __name__ == "__main__":
    anyio.run(serve_stdio, EchoAgent())
