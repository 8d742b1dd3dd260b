// An ACP v1 echo agent on the TypeScript SDK 2.4.0's stable (v1) API, over stdio: the SDK's
// `agent()` app with typed handlers, connected with `ndJsonStream` to this process's stdin and
// stdout. Driven by tests/interop/test_ts_v1_agent.py through acp-once's `AcpClient`.
//
//   node ts_v1_agent.mjs RECEIVED_LOG
//
// Every byte it reads from stdin is appended to RECEIVED_LOG (newline-delimited JSON-RPC: what
// the client sent, read from the agent's side). It answers `initialize` with v1 (the SDK's
// PROTOCOL_VERSION), whatever version was asked for, and does not offer `session/load`. A
// prompt's turn streams "echo: " and the prompt's text as two agent_message_chunk updates with
// a tool call between them, and is answered `{stopReason: "end_turn"}`; a prompt containing
// "[wait]" runs until `session/cancel`, then is answered `{stopReason: "cancelled"}`.

import { appendFileSync } from "node:fs";
import { randomUUID } from "node:crypto";
import { PassThrough, Readable, Writable } from "node:stream";

import * as acp from "@agentclientprotocol/sdk";

const [log] = process.argv.slice(2);
if (!log) {
  console.error("usage: node ts_v1_agent.mjs RECEIVED_LOG");
  process.exit(2);
}

const { methods } = acp;
/** session id -> the resolve function of a waiting turn's cancellation */
const waiting = new Map();
const sessions = new Set();

const app = acp
  .agent()
  .onRequest(methods.agent.initialize, () => ({
    protocolVersion: acp.PROTOCOL_VERSION,
    agentCapabilities: { loadSession: false },
    agentInfo: { name: "ts-v1-echo", version: "2.4.0" },
  }))
  .onRequest(methods.agent.session.new, () => {
    const sessionId = `ts_${randomUUID().replaceAll("-", "")}`;
    sessions.add(sessionId);
    return { sessionId };
  })
  .onRequest(methods.agent.session.prompt, async ({ params, client }) => {
    const { sessionId, prompt } = params;
    if (!sessions.has(sessionId)) {
      throw acp.RequestError.resourceNotFound(sessionId);
    }
    const text = prompt.map((block) => (block.type === "text" ? block.text : "")).join("");
    const update = (u) => client.notify(methods.client.session.update, { sessionId, update: u });
    const chunk = (t) => update({ sessionUpdate: "agent_message_chunk", content: { type: "text", text: t } });
    await chunk("echo: ");
    await update({ sessionUpdate: "tool_call", toolCallId: "tool1", title: "Think", kind: "think", status: "pending" });
    await update({ sessionUpdate: "tool_call_update", toolCallId: "tool1", status: "completed" });
    if (text.includes("[wait]")) {
      await new Promise((resolve) => waiting.set(sessionId, resolve));
      return { stopReason: "cancelled" };
    }
    await chunk(text);
    return { stopReason: "end_turn" };
  })
  .onNotification(methods.agent.session.cancel, ({ params }) => {
    waiting.get(params.sessionId)?.();
    waiting.delete(params.sessionId);
  });

// a tap on stdin: the SDK reads through the PassThrough, the log gets the same bytes
const input = new PassThrough();
process.stdin.on("data", (data) => appendFileSync(log, data));
process.stdin.pipe(input);
const stream = acp.ndJsonStream(Writable.toWeb(process.stdout), Readable.toWeb(input));
const connection = app.connect(stream);
await connection.closed;
