// The echo agent of benchmarks/ts_agent/agent.mjs on the ACP TypeScript SDK 2.4.0, served over
// WebSocket and Streamable HTTP by the SDK's experimental server (`AcpServer`, the
// experimental/node handlers, `ws` for upgrades), for benchmarks/bench_load.py: the TypeScript
// side of the remote comparison with `acp-once serve --store memory`.
//
//   node server.mjs [--port N]      (default: a free port)
//
// Prints `{"port": N}` once listening at ws://127.0.0.1:N/acp and http://127.0.0.1:N/acp.
// SIGTERM or SIGINT closes it.
//
// Keys are honoured, so the comparison is like for like: per session, a map from
// `idempotencyKey` to the `messageId` its prompt was given; a prompt whose key is in the map is
// answered with that `messageId` and nothing else happens. The SDK 2.4.0 typed `session/prompt`
// handler drops `idempotencyKey`, so the prompt is handled by the raw `"*"` request fallback,
// which receives the params as sent. Each turn reports user_message (before the answer),
// state_update running, agent_message (the prompt text), state_update idle; the turns of one
// session run in order.

import { createServer } from "node:http";
import { randomUUID } from "node:crypto";
import { parseArgs } from "node:util";

import * as acp from "@agentclientprotocol/sdk/experimental/v2";
import { AcpServer } from "@agentclientprotocol/sdk/experimental/server";
import {
  createNodeHttpHandler,
  createNodeWebSocketUpgradeHandler,
} from "@agentclientprotocol/sdk/experimental/node";
import { WebSocketServer } from "ws";

const { methods } = acp;
const { values: opts } = parseArgs({ options: { port: { type: "string", default: "0" } } });
const id = (prefix) => `${prefix}_${randomUUID().replaceAll("-", "")}`;

/** session id -> { messages: [...], keys: Map<key, messageId>, tail: Promise } */
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
    messageId: id("msg_agent"),
    content: [{ type: "text", text }],
  });
  await update({ sessionUpdate: "state_update", state: "idle", stopReason: "end_turn" });
}

async function prompt(params, client) {
  const session = sessions.get(params?.sessionId);
  if (session === undefined) {
    throw new acp.RequestError(-32002, "Session not found", { sessionId: params?.sessionId });
  }
  if (!Array.isArray(params.prompt)) {
    throw new acp.RequestError(-32602, "Invalid params: prompt must be an array");
  }
  const key = params.idempotencyKey;
  if (key !== undefined) {
    if (typeof key !== "string" || key.length === 0) {
      throw new acp.RequestError(-32602, "Invalid params: idempotencyKey must be a non-empty string");
    }
    const known = session.keys.get(key);
    if (known !== undefined) return { messageId: known };
  }
  const messageId = id("msg_user");
  const content = params.prompt;
  session.messages.push({ messageId, content }); // "inserted"
  if (key !== undefined) session.keys.set(key, messageId);
  await client.notify(methods.client.session.update, {
    sessionId: params.sessionId,
    update: { sessionUpdate: "user_message", messageId, content },
  });
  const text = textOf(content);
  session.tail = session.tail
    .then(() => runTurn(client, params.sessionId, text))
    .catch((err) => console.error("turn failed:", err));
  return { messageId };
}

const agent = acp
  .agent({ name: "ts-echo-server" })
  .onRequest(methods.agent.initialize, () => ({
    protocolVersion: acp.PROTOCOL_VERSION,
    info: { name: "ts-echo-server", version: "2.4.0" },
    capabilities: { session: {} },
  }))
  .onRequest(methods.agent.session.new, () => {
    const sessionId = id("sess");
    sessions.set(sessionId, { messages: [], keys: new Map(), tail: Promise.resolve() });
    return { sessionId };
  })
  .onRequest("*", ({ method, params, client }) => {
    if (method === "session/prompt") return prompt(params, client);
    throw new acp.RequestError(-32601, "Method not found", { method });
  })
  .onNotification(methods.agent.session.cancel, () => {});

const server = new AcpServer({ agent });
const handle = createNodeHttpHandler(server);
const http = createServer((req, res) => handle(req, res));
const webSockets = new WebSocketServer({ noServer: true, perMessageDeflate: false });
const upgrade = createNodeWebSocketUpgradeHandler(server, webSockets);
http.on("upgrade", (req, socket, head) => upgrade(req, socket, head));
// Node's defaults end idle keep-alive sockets after 5 s and requests after 300 s; SSE streams
// and idle benchmark connections stay open for as long as the run.
http.keepAliveTimeout = 0;
http.requestTimeout = 0;
http.headersTimeout = 0;
http.maxConnections = Infinity;

let closing = false;
async function shutdown() {
  if (closing) return;
  closing = true;
  await server.close();
  webSockets.close();
  http.closeAllConnections?.();
  http.close(() => process.exit(0));
}
process.on("SIGTERM", shutdown);
process.on("SIGINT", shutdown);

http.listen({ port: Number(opts.port), host: "127.0.0.1", backlog: 4096 }, () =>
  process.stdout.write(`${JSON.stringify({ port: http.address().port })}\n`),
);
