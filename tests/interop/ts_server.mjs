// A v2 agent on the ACP TypeScript SDK 2.4.0 served over Streamable HTTP and WebSocket with its
// experimental/server `AcpServer` and the experimental/node adapters (WebSocket upgrades through
// `createNodeWebSocketUpgradeHandler` and the `ws` package), on a free loopback port. Driven by
// tests/interop/test_ts_server.py.
//
//   node ts_server.mjs
//
// Prints `{"port": N}` once listening, then one JSON line per HTTP exchange (`{"http": {...}}`,
// written when its response is finished) or WebSocket upgrade (`{"upgrade": {...}}`) it served.
// With ACP_ONCE_TOKEN in the environment, a request or upgrade without `Authorization: Bearer
// <token>` is refused with 401 (the SDK's server has no authentication of its own).
// SIGTERM or SIGINT closes it.
//
// The agent: initialize, session/new, session/resume, session/prompt (answered {messageId} once
// the user message is kept in memory; the typed handler drops `idempotencyKey`, so no keys),
// session/cancel. Each turn reports user_message, state_update running, asks the client's
// permission (a session-scoped agent-to-client request), then agent_message (the prompt text
// and the chosen option) and state_update idle.

import { createServer } from "node:http";
import { randomUUID } from "node:crypto";

import * as acp from "@agentclientprotocol/sdk/experimental/v2";
import { AcpServer } from "@agentclientprotocol/sdk/experimental/server";
import {
  createNodeHttpHandler,
  createNodeWebSocketUpgradeHandler,
} from "@agentclientprotocol/sdk/experimental/node";
import { WebSocketServer } from "ws";

const { methods } = acp;
const id = (prefix) => `${prefix}_${randomUUID().replaceAll("-", "")}`;

/** session id -> { tail: Promise } */
const sessions = new Map();

function emit(line) {
  process.stdout.write(`${JSON.stringify(line)}\n`);
}

async function runTurn(client, sessionId, text) {
  const update = (u) => client.notify(methods.client.session.update, { sessionId, update: u });
  await update({ sessionUpdate: "state_update", state: "running" });
  const answer = await client.request(methods.client.session.requestPermission, {
    sessionId,
    title: "Echo the prompt back?",
    options: [
      { optionId: "yes", name: "Yes", kind: "allow_once" },
      { optionId: "no", name: "No", kind: "reject_once" },
    ],
  });
  const chosen = answer.outcome.outcome === "selected" ? answer.outcome.optionId : answer.outcome.outcome;
  await update({
    sessionUpdate: "agent_message",
    messageId: id("msg_agent"),
    content: [{ type: "text", text: `${text} [permission: ${chosen}]` }],
  });
  await update({ sessionUpdate: "state_update", state: "idle", stopReason: "end_turn" });
}

const agent = acp
  .agent({ name: "ts-remote-agent" })
  .onRequest(methods.agent.initialize, () => ({
    protocolVersion: acp.PROTOCOL_VERSION,
    info: { name: "ts-remote-agent", version: "2.4.0" },
    capabilities: { session: { resume: {} } },
  }))
  .onRequest(methods.agent.session.new, () => {
    const sessionId = id("sess");
    sessions.set(sessionId, { tail: Promise.resolve() });
    return { sessionId };
  })
  .onRequest(methods.agent.session.resume, ({ params }) => {
    if (!sessions.has(params.sessionId)) {
      throw new acp.RequestError(-32002, "Session not found", { sessionId: params.sessionId });
    }
    return {};
  })
  .onRequest(methods.agent.session.prompt, async ({ params, client }) => {
    const session = sessions.get(params.sessionId);
    if (session === undefined) {
      throw new acp.RequestError(-32002, "Session not found", { sessionId: params.sessionId });
    }
    const messageId = id("msg_user");
    await client.notify(methods.client.session.update, {
      sessionId: params.sessionId,
      update: { sessionUpdate: "user_message", messageId, content: params.prompt },
    });
    const text = params.prompt
      .filter((block) => block.type === "text")
      .map((block) => block.text)
      .join("\n");
    session.tail = session.tail
      .then(() => runTurn(client, params.sessionId, text))
      .catch((err) => console.error("turn failed:", err));
    return { messageId };
  })
  .onNotification(methods.agent.session.cancel, () => {});

const token = process.env.ACP_ONCE_TOKEN;
const authorized = (req) => !token || req.headers.authorization === `Bearer ${token}`;

const server = new AcpServer({ agent });
const handle = createNodeHttpHandler(server);
const http = createServer((req, res) => {
  res.once("finish", () =>
    emit({
      http: {
        method: req.method,
        status: res.statusCode,
        connectionId: req.headers["acp-connection-id"] ?? null,
        sessionId: req.headers["acp-session-id"] ?? null,
      },
    }),
  );
  if (!authorized(req)) {
    res.writeHead(401, { "Content-Type": "text/plain", "WWW-Authenticate": "Bearer" });
    res.end("missing or wrong bearer token");
    return;
  }
  handle(req, res);
});
const webSockets = new WebSocketServer({ noServer: true });
const upgrade = createNodeWebSocketUpgradeHandler(server, webSockets);
http.on("upgrade", (req, socket, head) => {
  emit({ upgrade: { url: req.url, authorized: authorized(req) } });
  if (!authorized(req)) {
    socket.end("HTTP/1.1 401 Unauthorized\r\nConnection: close\r\nContent-Length: 0\r\n\r\n");
    return;
  }
  upgrade(req, socket, head);
});

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

http.listen(0, "127.0.0.1", () => emit({ port: http.address().port }));
