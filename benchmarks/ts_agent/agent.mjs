// A tiny ACP v2 echo agent on the official TypeScript SDK (@agentclientprotocol/sdk 2.4.0,
// entrypoint "@agentclientprotocol/sdk/experimental/v2"), for benchmarks/bench_agent.py.
//
// It does the same "echo turn" as acp-once's reference agent, over stdio (NDJSON):
//   session/prompt is answered {messageId} once the user message is "inserted" (kept in memory),
//   and the session gets: user_message, state_update running, agent_message (the prompt text),
//   state_update idle (stopReason end_turn). Turns of one session run in order.
//
// No idempotency keys: the SDK 2.4.0 schema does not know `idempotencyKey` and drops it.
//
//   node benchmarks/ts_agent/agent.mjs

import { randomUUID } from "node:crypto";
import { Readable, Writable } from "node:stream";

import * as acp from "@agentclientprotocol/sdk/experimental/v2";

const { methods } = acp;

/** session id -> { messages: [...], tail: Promise } */
const sessions = new Map();

function textOf(prompt) {
  return prompt
    .filter((block) => block.type === "text")
    .map((block) => block.text)
    .join("\n");
}

async function runTurn(client, sessionId, text) {
  const update = (u) => client.notify(methods.client.session.update, { sessionId, update: u });
  await update({ sessionUpdate: "state_update", state: "running" });
  await update({
    sessionUpdate: "agent_message",
    messageId: `msg_agent_${randomUUID().replaceAll("-", "")}`,
    content: [{ type: "text", text }],
  });
  await update({ sessionUpdate: "state_update", state: "idle", stopReason: "end_turn" });
}

const app = acp
  .agent({ name: "ts-echo-agent" })
  .onRequest(methods.agent.initialize, () => ({
    protocolVersion: acp.PROTOCOL_VERSION,
    info: { name: "ts-echo-agent", version: "2.4.0" },
    capabilities: { session: {} },
  }))
  .onRequest(methods.agent.session.new, () => {
    const sessionId = `sess_${randomUUID().replaceAll("-", "")}`;
    sessions.set(sessionId, { messages: [], tail: Promise.resolve() });
    return { sessionId };
  })
  .onRequest(methods.agent.session.prompt, async ({ params, client }) => {
    const session = sessions.get(params.sessionId);
    if (session === undefined) {
      throw new acp.RequestError(-32002, "Session not found", { sessionId: params.sessionId });
    }
    const messageId = `msg_user_${randomUUID().replaceAll("-", "")}`;
    const content = params.prompt;
    session.messages.push({ messageId, content }); // "inserted"
    await client.notify(methods.client.session.update, {
      sessionId: params.sessionId,
      update: { sessionUpdate: "user_message", messageId, content },
    });
    const text = textOf(content);
    session.tail = session.tail
      .then(() => runTurn(client, params.sessionId, text))
      .catch((err) => console.error("turn failed:", err));
    return { messageId };
  })
  .onNotification(methods.agent.session.cancel, () => {});

const connection = app.connect(
  acp.ndJsonStream(Writable.toWeb(process.stdout), Readable.toWeb(process.stdin)),
);
await connection.closed;
