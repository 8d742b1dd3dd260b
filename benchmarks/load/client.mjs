// A thin ACP v2 load client, in a process of its own, for benchmarks/bench_load.py: raw
// WebSocket (`ws`) or raw Streamable HTTP (`undici`), no ACP library, so the client costs little
// CPU beside the server it measures.
//
//   node client.mjs --transport ws --url ws://127.0.0.1:8765/acp --connections 500
//   node client.mjs --transport http --url http://127.0.0.1:8765/acp --connections 20
//
// Each of N connections does `initialize` (protocolVersion 2) and `session/new`, then (the first
// --active of them, default all) keyed `session/prompt`s back to back, a fresh `idempotencyKey`
// per prompt. A prompt counts when its `{messageId}` answer and the turn's idle `state_update`
// have both arrived; its latency runs from the send to the later of the two. Prompts that end
// inside the measured window (after --warmup seconds, for --duration seconds) are counted.
//
// Over HTTP a connection is: POST initialize (200, Acp-Connection-Id), the connection's GET SSE
// stream, POST session/new (202; answered on that stream), the session's GET SSE stream, then
// POSTed prompts (202; answered with the updates on the session's stream). With
// --http-connection-stream close, a client closes its connection's stream once its session
// exists (one socket per idle client instead of two).
//
// --no-session: connections only initialize (to tell what a session adds to an idle connection).
// --url may be repeated (the nodes of a cluster): connection i goes to the (i mod n)-th.
//
// Connections are spread over --addresses loopback source addresses (127.0.0.1, .2, ...) the way
// clients of a real service come from many addresses, and at most --open-concurrency of them
// are being opened at a time.
//
// Output, one JSON line each on stdout:
//   {"opened": {"connections", "failed", "seconds", "errors"}}   once every connection is open
//   (with --wait-go: then waits for a line "go" on stdin, so the caller can measure idle memory)
//   {"window": "start"} and {"window": "end"}, when the measured window starts and ends (so the
//   caller can read the server's CPU time over the same window)
//   {"result": {"prompts", "seconds", "promptsPerSecond", "p50Ms", "p99Ms", "errors", ...}}
// and exits. Exit status 1 when no connection could be opened.

import { randomUUID } from "node:crypto";
import { createInterface } from "node:readline";
import { performance } from "node:perf_hooks";
import { parseArgs } from "node:util";

import { Agent, request } from "undici";
import WebSocket from "ws";

const { values: opts } = parseArgs({
  options: {
    transport: { type: "string", default: "ws" },
    url: { type: "string", multiple: true },
    connections: { type: "string", default: "20" },
    active: { type: "string" },
    warmup: { type: "string", default: "2" },
    duration: { type: "string", default: "5" },
    "open-concurrency": { type: "string" },
    addresses: { type: "string", default: "0" },
    "open-timeout": { type: "string", default: "120" },
    "wait-go": { type: "boolean", default: false },
    "http-connection-stream": { type: "string", default: "keep" },
    text: { type: "string", default: "hello" },
    "no-session": { type: "boolean", default: false },
  },
});

const TRANSPORT = opts.transport;
const URLS = opts.url ?? [];
// With several --url (the nodes of a cluster), connection i goes to URLS[i % URLS.length].
const urlOf = (index) => URLS[index % URLS.length];
const N = Number(opts.connections);
const ACTIVE = opts.active === undefined ? N : Math.min(N, Number(opts.active));
const WARMUP_MS = Number(opts.warmup) * 1000;
const DURATION_MS = Number(opts.duration) * 1000;
// Defaults below `acp-once serve`'s caps: 256 half-open connections per address (1,024 in all),
// 100 HTTP connections that have not opened a stream yet, 512 connections per address. An HTTP
// client holds up to three sockets (its two SSE streams and one for POSTs). Beyond 10 HTTP
// connections per address without a stream, `serve` answers initialize 503: it is tried again.
const OPEN_CONCURRENCY = Number(opts["open-concurrency"] ?? (TRANSPORT === "ws" ? 200 : 50));
const PER_ADDRESS = TRANSPORT === "ws" ? 400 : 150;
const ADDRESSES = Number(opts.addresses) > 0 ? Number(opts.addresses) : Math.max(1, Math.ceil(N / PER_ADDRESS));
const OPEN_TIMEOUT_MS = Number(opts["open-timeout"]) * 1000;
const KEEP_CONNECTION_STREAM = opts["http-connection-stream"] === "keep";
const PROMPT = [{ type: "text", text: opts.text }];
const RUN = randomUUID().slice(0, 8);

if (URLS.length === 0 || !["ws", "http"].includes(TRANSPORT) || !(N >= 1)) {
  process.stderr.write("usage: client.mjs --transport ws|http --url URL --connections N [...]\n");
  process.exit(2);
}

const emit = (line) => process.stdout.write(`${JSON.stringify(line)}\n`);
const sourceAddress = (i) => `127.0.0.${1 + (i % ADDRESSES)}`;

/** The measured window and what ended inside it. */
const window = {
  running: false,
  start: Infinity,
  end: Infinity,
  latencies: new Float64Array(1 << 16),
  count: 0,
  errors: 0,
  errorSamples: [],
  record(t0, t1) {
    if (t1 < this.start || t1 > this.end) return;
    if (this.count === this.latencies.length) {
      const grown = new Float64Array(this.latencies.length * 2);
      grown.set(this.latencies);
      this.latencies = grown;
    }
    this.latencies[this.count++] = t1 - t0;
  },
  error(message) {
    this.errors += 1;
    if (this.errorSamples.length < 5) this.errorSamples.push(String(message).slice(0, 300));
  },
};

function withTimeout(promise, ms, what) {
  let timer;
  const timeout = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new Error(`${what}: no answer within ${ms} ms`)), ms);
  });
  return Promise.race([promise, timeout]).finally(() => clearTimeout(timer));
}

/** One ACP connection's client side, whatever the transport: requests by id, the prompt loop. */
class Peer {
  constructor(index) {
    this.index = index;
    this.nextId = 1;
    this.waiting = new Map(); // id -> {resolve, reject} for initialize / session/new
    this.sessionId = null;
    this.promptSeq = 0;
    this.pending = null; // {id, t0, answered, idle}
    this.closed = false;
    this.onDrained = null;
  }

  call(method, params) {
    const id = this.nextId++;
    const answer = new Promise((resolve, reject) => this.waiting.set(id, { resolve, reject }));
    this.sendFrame(JSON.stringify({ jsonrpc: "2.0", id, method, params }), params.sessionId);
    return answer;
  }

  handle(text) {
    const message = JSON.parse(text);
    if (message.id !== undefined && message.method === undefined) {
      const pending = this.pending;
      if (pending !== null && message.id === pending.id) {
        if (message.error !== undefined) {
          window.error(`session/prompt: ${JSON.stringify(message.error)}`);
          this.finish(false);
          return;
        }
        pending.answered = true;
        if (pending.idle) this.finish(true);
        return;
      }
      const waiter = this.waiting.get(message.id);
      if (waiter !== undefined) {
        this.waiting.delete(message.id);
        if (message.error !== undefined) waiter.reject(new Error(JSON.stringify(message.error)));
        else waiter.resolve(message.result);
      }
      return;
    }
    if (message.method === "session/update") {
      const update = message.params.update;
      if (update.sessionUpdate === "state_update" && update.state === "idle" && this.pending !== null) {
        this.pending.idle = true;
        if (this.pending.answered) this.finish(true);
      }
    } else if (message.id !== undefined) {
      // An agent-to-client request the echo agents never send: refuse it, so nothing waits.
      this.sendFrame(
        JSON.stringify({ jsonrpc: "2.0", id: message.id, error: { code: -32601, message: "not supported" } }),
        message.params?.sessionId,
      );
    }
  }

  async open() {
    this.step = "connect";
    await this.connect();
    this.step = "initialize";
    await this.call("initialize", {
      protocolVersion: 2,
      capabilities: {},
      info: { name: "acp-once-load-client", version: "0.0.0" },
    });
    if (opts["no-session"]) return; // idle connections only, for what a session adds to them
    this.step = "session/new";
    const created = await this.call("session/new", { cwd: "/tmp" });
    this.sessionId = created.sessionId;
    this.step = "the session's stream";
    await this.sessionReady();
  }

  prompt() {
    if (!window.running || this.closed) {
      this.pending = null;
      if (this.onDrained !== null) this.onDrained();
      return;
    }
    const id = this.nextId++;
    const key = `load-${RUN}-${this.index}-${this.promptSeq++}`;
    this.pending = { id, t0: performance.now(), answered: false, idle: false };
    this.sendFrame(
      JSON.stringify({
        jsonrpc: "2.0",
        id,
        method: "session/prompt",
        params: { sessionId: this.sessionId, idempotencyKey: key, prompt: PROMPT },
      }),
      this.sessionId,
    );
  }

  finish(ok) {
    const pending = this.pending;
    this.pending = null;
    if (ok) window.record(pending.t0, performance.now());
    this.prompt();
  }

  failed(err) {
    if (this.closed) return;
    this.closed = true;
    for (const waiter of this.waiting.values()) waiter.reject(err);
    this.waiting.clear();
    if (window.running) window.error(`connection ${this.index} lost: ${err.message}`);
    if (this.pending !== null) {
      this.pending = null;
    }
    if (this.onDrained !== null) this.onDrained();
  }
}

class WsPeer extends Peer {
  connect() {
    return new Promise((resolve, reject) => {
      const ws = new WebSocket(urlOf(this.index), { localAddress: sourceAddress(this.index), perMessageDeflate: false });
      this.ws = ws;
      ws.on("open", resolve);
      ws.on("error", (err) => {
        reject(err);
        this.failed(err);
      });
      ws.on("unexpected-response", (_req, res) => {
        const err = new Error(`upgrade refused: HTTP ${res.statusCode}`);
        reject(err);
        this.failed(err);
        ws.terminate();
      });
      ws.on("close", (code, reason) => this.failed(new Error(`closed ${code} ${reason}`)));
      ws.on("message", (data, isBinary) => {
        if (!isBinary) this.handle(data.toString());
      });
    });
  }

  sendFrame(text) {
    this.ws.send(text);
  }

  sessionReady() {
    return Promise.resolve();
  }

  close() {
    this.closed = true;
    this.ws.terminate();
  }
}

const dispatchers = new Map();
function dispatcherFor(index) {
  const address = sourceAddress(index);
  let dispatcher = dispatchers.get(address);
  if (dispatcher === undefined) {
    dispatcher = new Agent({
      localAddress: address,
      // below the 5 s after which `serve` closes an idle kept-alive socket
      keepAliveTimeout: 4_000,
      keepAliveMaxTimeout: 4_000,
      headersTimeout: 0,
      bodyTimeout: 0,
    });
    dispatchers.set(address, dispatcher);
  }
  return dispatcher;
}

class HttpPeer extends Peer {
  constructor(index) {
    super(index);
    this.dispatcher = dispatcherFor(index);
    this.url = urlOf(index);
    this.connectionId = null;
    this.streams = [];
  }

  async connect() {
    // initialize is POSTed before anything else: its answer is the 200 body, not a stream event
  }

  async call(method, params) {
    if (method !== "initialize") return super.call(method, params);
    const id = this.nextId++;
    let res;
    let body;
    // 503 with Retry-After: a client opening many connections at once waits a moment and tries
    // again, as a real one would (shorter than the header's second: opening is not measured)
    for (let attempt = 0; ; attempt++) {
      res = await request(this.url, {
        method: "POST",
        dispatcher: this.dispatcher,
        headers: { "content-type": "application/json", accept: "application/json, text/event-stream" },
        body: JSON.stringify({ jsonrpc: "2.0", id, method, params }),
      });
      body = await res.body.text();
      if (res.statusCode !== 503 || res.headers["retry-after"] === undefined || attempt >= 20) break;
      await new Promise((resolve) => setTimeout(resolve, 50 + Math.random() * 200));
    }
    if (res.statusCode !== 200) throw new Error(`initialize: HTTP ${res.statusCode} ${body.slice(0, 200)}`);
    this.connectionId = res.headers["acp-connection-id"];
    if (!this.connectionId) throw new Error("initialize: no Acp-Connection-Id");
    this.step = "the connection's stream";
    await this.openStream(null);
    return JSON.parse(body).result;
  }

  async openStream(sessionId) {
    const headers = { accept: "text/event-stream", "acp-connection-id": this.connectionId };
    if (sessionId !== null) headers["acp-session-id"] = sessionId;
    const res = await request(this.url, { method: "GET", dispatcher: this.dispatcher, headers });
    if (res.statusCode !== 200) {
      const body = await res.body.text();
      throw new Error(`GET stream: HTTP ${res.statusCode} ${body.slice(0, 200)}`);
    }
    const stream = { body: res.body, sessionId };
    this.streams.push(stream);
    let buffer = "";
    res.body.setEncoding("utf8");
    res.body.on("data", (chunk) => {
      buffer += chunk;
      let end;
      while ((end = buffer.indexOf("\n\n")) !== -1) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        let data = null;
        for (const line of event.split("\n")) {
          if (line.startsWith("data:")) {
            const value = line.charCodeAt(5) === 32 ? line.slice(6) : line.slice(5);
            data = data === null ? value : `${data}\n${value}`;
          }
        }
        if (data !== null) this.handle(data);
      }
    });
    res.body.on("error", (err) => {
      if (!stream.closing) this.failed(err);
    });
    res.body.on("end", () => {
      if (!stream.closing) this.failed(new Error("stream ended"));
    });
  }

  async sessionReady() {
    await this.openStream(this.sessionId);
    if (!KEEP_CONNECTION_STREAM) {
      const connectionStream = this.streams.shift();
      connectionStream.closing = true;
      connectionStream.body.destroy();
    }
  }

  sendFrame(text, sessionId) {
    const headers = { "content-type": "application/json", "acp-connection-id": this.connectionId };
    if (sessionId !== undefined && sessionId !== null) headers["acp-session-id"] = sessionId;
    request(this.url, { method: "POST", dispatcher: this.dispatcher, headers, body: text }).then(
      async (res) => {
        const body = await res.body.text();
        if (res.statusCode !== 202 && res.statusCode !== 200) {
          this.failed(new Error(`POST: HTTP ${res.statusCode} ${body.slice(0, 200)}`));
        }
      },
      (err) => this.failed(err),
    );
  }

  close() {
    this.closed = true;
    for (const stream of this.streams) {
      stream.closing = true;
      stream.body.destroy();
    }
  }
}

async function openAll() {
  const peers = [];
  const errors = new Map();
  let failed = 0;
  let next = 0;
  const started = performance.now();
  async function worker() {
    while (next < N) {
      const peer = TRANSPORT === "ws" ? new WsPeer(next++) : new HttpPeer(next++);
      try {
        await withTimeout(peer.open(), OPEN_TIMEOUT_MS, "opening a connection").catch((err) => {
          throw peer.step !== undefined && err.message.startsWith("opening") ? new Error(`${err.message} (at ${peer.step})`) : err;
        });
        peers.push(peer);
      } catch (err) {
        failed += 1;
        const message = String(err?.message ?? err).slice(0, 200);
        errors.set(message, (errors.get(message) ?? 0) + 1);
        peer.closed = true;
      }
    }
  }
  await Promise.all(Array.from({ length: Math.min(OPEN_CONCURRENCY, N) }, worker));
  const seconds = (performance.now() - started) / 1000;
  return { peers, failed, seconds, errors: Object.fromEntries(errors) };
}

async function waitForGo() {
  const lines = createInterface({ input: process.stdin });
  for await (const line of lines) {
    if (line.trim() === "go") return;
  }
  process.exit(0); // stdin closed: the caller is gone
}

async function main() {
  const { peers, failed, seconds, errors } = await openAll();
  emit({ opened: { connections: peers.length, failed, seconds, errors, addresses: ADDRESSES } });
  if (peers.length === 0) process.exit(1);
  if (opts["wait-go"]) await waitForGo();

  const active = peers.slice(0, ACTIVE).filter((peer) => !peer.closed);
  const now = performance.now();
  window.start = now + WARMUP_MS;
  window.end = window.start + DURATION_MS;
  window.running = true;
  for (const peer of active) peer.prompt();
  await new Promise((resolve) => setTimeout(resolve, WARMUP_MS));
  emit({ window: "start" });
  await new Promise((resolve) => setTimeout(resolve, window.end - performance.now()));
  emit({ window: "end" });
  window.running = false;
  // Let the prompts in flight end (bounded), so the server is quiet when the caller reads it.
  await withTimeout(
    Promise.all(
      active.map(
        (peer) =>
          new Promise((resolve) => {
            if (peer.pending === null || peer.closed) resolve();
            else peer.onDrained = resolve;
          }),
      ),
    ),
    10_000,
    "draining",
  ).catch(() => {});

  const latencies = window.latencies.subarray(0, window.count).sort();
  const quantile = (q) =>
    latencies.length === 0 ? null : latencies[Math.min(latencies.length - 1, Math.floor(q * latencies.length))];
  emit({
    result: {
      transport: TRANSPORT,
      connections: peers.length,
      active: active.length,
      prompts: window.count,
      seconds: DURATION_MS / 1000,
      promptsPerSecond: window.count / (DURATION_MS / 1000),
      p50Ms: quantile(0.5),
      p99Ms: quantile(0.99),
      errors: window.errors,
      errorSamples: window.errorSamples,
      lost: active.filter((peer) => peer.closed).length,
    },
  });
  for (const peer of peers) peer.close();
  process.exit(0);
}

main().catch((err) => {
  process.stderr.write(`load client failed: ${err?.stack ?? err}\n`);
  process.exit(1);
});
