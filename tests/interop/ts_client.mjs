// The ACP TypeScript SDK 2.4.0 as a client of an acp-once server, over WebSocket or Streamable
// HTTP (its experimental/ws-client and experimental/http-client transports). Driven by
// tests/interop/test_ts_client.py.
//
//   node ts_client.mjs run ws|http URL KEY     the whole exchange below; prints one JSON object
//   node ts_client.mjs refused ws|http URL     initialize only; prints how it failed
//   node ts_client.mjs idle http URL KEY BODY_TIMEOUT_MS IDLE_MS
//       over a fetch whose body timeout is BODY_TIMEOUT_MS (Node's own is 300 s): initialize,
//       session/new, IDLE_MS of silence, then a keyed prompt; prints the answer or the failure
//
// The bearer token, if any, comes from the ACP_ONCE_TOKEN environment variable.
//
// `run`: connection 1 initializes, creates a session, sends a prompt with an empty key (which
// must be refused with -32602), then the same keyed prompt twice (a raw `request`: the typed v2
// API of 2.4.0 has no key parameter, but the raw params go on the wire as they are), and waits
// for the agent's agent_message and idle updates. Connection 2 (a new transport connection)
// initializes, resumes the session and sends the same key a third time. What the transport saw
// (HTTP statuses and ACP headers, or the 101's Acp-Connection-Id) is printed too.

import * as acp from "@agentclientprotocol/sdk/experimental/v2";
import { createHttpStream } from "@agentclientprotocol/sdk/experimental/http-client";
import { createWebSocketStream } from "@agentclientprotocol/sdk/experimental/ws-client";
import { setTimeout as sleep } from "node:timers/promises";
import { Agent, fetch as undiciFetch } from "undici";
import WebSocket from "ws";

const [mode, transport, url, key, ...numbers] = process.argv.slice(2);
const MODES = ["run", "refused", "idle"];
if (!MODES.includes(mode) || !["ws", "http"].includes(transport) || !url) {
  console.error("usage: node ts_client.mjs run|refused|idle ws|http URL [KEY [MS MS]]");
  process.exit(2);
}
const [bodyTimeoutMs, idleMs] = numbers.map(Number);
const TIMEOUT_MS = 20_000;
const token = process.env.ACP_ONCE_TOKEN;
const headers = token ? { Authorization: `Bearer ${token}` } : {};

/** What the transport saw: HTTP exchanges in the order they were sent, or WebSocket upgrades. */
const wire = [];
/** Exchanges still waiting for their response: a POST's 202 may come after the JSON-RPC
 * response it caused has arrived on an SSE stream (nothing orders the two). */
const inFlight = new Set();

/** fetch, recording each exchange's method, status and ACP headers (never the token). */
function recordingFetch(input, init) {
  return record(fetch, input, init);
}

/** undici's fetch (what Node's is built on) with a short body timeout: Node's fetch gives up on
 * a response body silent for 300 s, and the SDK's client then closes its whole connection. */
function impatientFetch(input, init) {
  return record(undiciFetch, input, { ...init, dispatcher: impatientFetch.dispatcher });
}

function record(fetchImpl, input, init) {
  const sent = new Headers(init?.headers);
  const entry = {
    method: init?.method ?? "GET",
    status: null,
    sentConnectionId: sent.get("acp-connection-id"),
    sentSessionId: sent.get("acp-session-id"),
    connectionId: null,
    contentType: null,
  };
  wire.push(entry);
  const done = fetchImpl(input, init).then((response) => {
    entry.status = response.status;
    entry.connectionId = response.headers.get("acp-connection-id");
    entry.contentType = response.headers.get("content-type");
    return response;
  });
  // the SDK aborts the POSTs still waiting for their status when it closes the connection
  const settled = done
    .catch((error) => {
      entry.failed = String(error?.name ?? error);
    })
    .finally(() => inFlight.delete(settled));
  inFlight.add(settled);
  return done;
}

/** Wait (bounded) until every recorded exchange has its status. */
async function settleWire() {
  await withTimeout(Promise.all([...inFlight]), "HTTP exchanges");
}

/** The `ws` WebSocket (Node 20 has no global one), recording the 101's Acp-Connection-Id. A
 * refused upgrade is an "error" event saying the status ("Unexpected server response: 401"):
 * an "unexpected-response" listener here would stop `ws` from reporting it to the SDK. */
class RecordingWebSocket extends WebSocket {
  constructor(address, protocols, options) {
    super(address, protocols, options);
    this.once("upgrade", (response) => {
      wire.push({
        upgrade: response.statusCode,
        connectionId: response.headers["acp-connection-id"] ?? null,
      });
    });
  }
}

function openStream() {
  if (transport === "ws") {
    return createWebSocketStream(url, { WebSocket: RecordingWebSocket, headers });
  }
  return createHttpStream(url, { fetch: mode === "idle" ? impatientFetch : recordingFetch, headers });
}

function withTimeout(promise, what) {
  let timer;
  const timeout = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new Error(`timed out: ${what}`)), TIMEOUT_MS);
  });
  return Promise.race([promise, timeout]).finally(() => clearTimeout(timer));
}

/** Every session/update received, in order, and waiters for one that matches a test. */
const updates = [];
const waiters = [];
function onUpdate({ params }) {
  updates.push(params);
  for (const waiter of [...waiters]) {
    if (waiter.test(params)) {
      waiters.splice(waiters.indexOf(waiter), 1);
      waiter.resolve(params);
    }
  }
}
function waitForUpdate(test, what) {
  const found = updates.find(test);
  if (found) return Promise.resolve(found);
  return withTimeout(new Promise((resolve) => waiters.push({ test, resolve })), what);
}

const INIT = {
  protocolVersion: acp.PROTOCOL_VERSION,
  info: { name: "ts-sdk-interop-client", version: "2.4.0" },
  capabilities: {},
};
const PROMPT = [{ type: "text", text: "hello from the TypeScript SDK" }];

const app = acp
  .client({ name: "ts-sdk-interop-client" })
  .onNotification(acp.methods.client.session.update, onUpdate);

function errorOf(error) {
  return {
    code: error?.code ?? null,
    message: String(error?.message ?? error),
    cause: error?.cause?.code ?? null, // undici's, e.g. UND_ERR_BODY_TIMEOUT
  };
}

async function refused() {
  try {
    await withTimeout(
      app.connectWith(openStream(), (ctx) => ctx.request(acp.methods.agent.initialize, INIT)),
      "initialize",
    );
    return { refused: false, wire };
  } catch (error) {
    return { refused: true, error: errorOf(error), wire };
  }
}

async function run() {
  const result = { transport };
  result.first = await withTimeout(
    app.connectWith(openStream(), async (ctx) => {
      const init = await ctx.request(acp.methods.agent.initialize, INIT);
      const { sessionId } = await ctx.request(acp.methods.agent.session.new, { cwd: "/tmp" });
      let emptyKey;
      try {
        emptyKey = { result: await ctx.request("session/prompt", { sessionId, idempotencyKey: "", prompt: PROMPT }) };
      } catch (error) {
        emptyKey = { error: errorOf(error) };
      }
      const first = await ctx.request("session/prompt", { sessionId, idempotencyKey: key, prompt: PROMPT });
      const again = await ctx.request("session/prompt", { sessionId, idempotencyKey: key, prompt: PROMPT });
      const ofSession = (kind) => (u) => u.sessionId === sessionId && u.update?.sessionUpdate === kind;
      const reply = await waitForUpdate(ofSession("agent_message"), "agent_message");
      await waitForUpdate((u) => ofSession("state_update")(u) && u.update.state === "idle", "idle");
      return { agent: init.info, sessionId, emptyKey, first, again, reply: reply.update };
    }),
    "connection 1",
  );
  const sessionId = result.first.sessionId;
  result.second = await withTimeout(
    app.connectWith(openStream(), async (ctx) => {
      await ctx.request(acp.methods.agent.initialize, INIT);
      const resumed = await ctx.request(acp.methods.agent.session.resume, { sessionId, cwd: "/tmp" });
      const retry = await ctx.request("session/prompt", { sessionId, idempotencyKey: key, prompt: PROMPT });
      return { resumed, retry };
    }),
    "connection 2",
  );
  result.updates = updates;
  result.wire = wire;
  return result;
}

async function idle() {
  impatientFetch.dispatcher = new Agent({ bodyTimeout: bodyTimeoutMs });
  try {
    return await withTimeout(
      app.connectWith(openStream(), async (ctx) => {
        await ctx.request(acp.methods.agent.initialize, INIT);
        const { sessionId } = await ctx.request(acp.methods.agent.session.new, { cwd: "/tmp" });
        await sleep(idleMs); // the silence under test: no message either way
        const answer = await ctx.request("session/prompt", { sessionId, idempotencyKey: key, prompt: PROMPT });
        return { sessionId, answer };
      }),
      "idle connection",
    );
  } catch (error) {
    return { failed: errorOf(error) };
  } finally {
    await impatientFetch.dispatcher.close();
  }
}

try {
  const result = await { run, refused, idle }[mode]();
  await settleWire();
  console.log(JSON.stringify(result));
} catch (error) {
  console.error(error);
  console.log(JSON.stringify({ failed: errorOf(error), wire }));
  process.exitCode = 1;
}
