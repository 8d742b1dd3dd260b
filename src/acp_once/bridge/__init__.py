"""A stdio ACP agent served over WebSocket and Streamable HTTP: `acp-once bridge -- CMD ARGS`.

    async with Bridge(["acp-once", "agent", "--store", "sqlite:s.db"]) as bridge:
        app = create_app(None, token=token, handler=bridge.serve)
        await uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=8765)).serve()

One child process (the stdio agent) serves every remote connection. The bridge is a JSON-RPC
proxy, not an agent: it decodes each message only to rewrite its id for the next hop and to
keep track of sessions; params travel untouched (re-encoded from the parsed JSON, so
`idempotencyKey` reaches the child exactly as the client sent it, R42), and a notification's
frame is forwarded as it arrived. Keys are never logged or sent anywhere but to the child.

- **Ids per hop.** A remote request gets a fresh child-side id; the answer goes back with the
  remote id. `$/cancel_request` is translated per hop (D26): the remote id becomes the child
  id; a cancel for an unknown or answered id is dropped. Requests the child sends toward the
  client get an id of the remote connection they are sent on, and the answer goes back to the
  child under the child's id; the child's `$/cancel_request` for one is translated likewise.
- **Batches** (D44). A remote batch is split into lone messages for the child, each meeting
  every rule on its own, and the answers to its requests are joined into one array for the
  client. The child is sent no batch, and one from it gets a single -32600.
- **Order.** Each remote connection's messages are forwarded in arrival order from its reader
  (a `session/cancel` can never overtake the prompt sent before it, D33); answers and updates
  from the child are queued per remote connection (bounded: when a connection's queue is
  full the child's messages wait a few seconds, then that connection is closed with 1008),
  so a slow client cannot stall the others for long.
- **`initialize` is answered by the bridge.** The child is initialized once per process, at
  its start, by the bridge (`client_capabilities`, none by default: one child connection
  serves clients with different capabilities, so it claims only what all of them have). The
  child rejects `initialize` after its first other request, so a remote `initialize` cannot
  be forwarded; the bridge answers it from the child's answer (`info`, `capabilities`,
  `authMethods`, `_meta` unchanged) with the version negotiated per D23 against the
  version the child speaks (-32022 below it). The initialize rules (-32600 before and after)
  apply per remote connection.
- **v1 clients.** A remote connection whose first message is an `initialize` asking for
  `protocolVersion: 1` is served by the agent side's v1 face over a v2 connection to the bridge
  itself, made in memory (`acp_once.bridge.v1`): everything above applies to it, and it is
  answered as a v1 client of the child would be (prompts answered at the end of their turns,
  no keys).
- **Sessions per remote connection.** A session is active on a remote connection once its
  `session/new` or `session/fork` answer names it, or its `session/resume` succeeds (while the
  resume is in flight it receives the session's updates: the replay and the state snapshot).
  `session/prompt`, `session/fork`, `session/set_config_option`, `tool_call/cancel` and
  `terminal/cancel` for a session not active on that connection get -32002 from the bridge, as
  the child would answer on a connection of its own; `session/cancel` for one is dropped;
  `session/close` for one succeeds (D24). `session/update` goes to every remote connection
  the session is active on, except during a resume that asked for replay: then only to the
  resuming connection, so others do not see the history twice (live updates sent in that
  window reach only the resumer). Requests from the child with a `sessionId` go to one remote
  connection the session is active on; when that connection ends unanswered they are resent
  on another one (they are Idempotent), and when there is none (or no `sessionId` names one)
  the child gets the method's cancellation answer (`session/request_permission`: outcome
  `cancelled`, "not approved"; others -32800). Notifications without a `sessionId` go to
  every initialized remote connection.
- **`session/close` and `session/delete`.** To the child, all remote connections are one
  connection. A close from the last remote connection the session is active on is forwarded;
  from any other, the bridge sends the child `session/cancel` (closing stops the work, as the
  agent does for a close on one of several connections), waits (bounded) for the session's
  idle `state_update` so the closing connection sees the final updates, then detaches only
  that connection and answers.
  A successful `session/delete` detaches the session from every remote connection.
- **A remote connection ends** (D11, as the reference agent does per connection): its
  sessions stay active in the child and are resumable from any connection; work goes on. Its
  requests still pending at the child are cancelled per hop with `$/cancel_request`, except a
  keyed `session/prompt` for which another live connection has a request pending (a retry
  with the same key): a held prompt nobody can hear is withdrawn (its key stays unused, so
  the client's retry inserts it once), and one still awaited elsewhere stays held. An
  already inserted prompt is unaffected by the cancel (R27).
- **The child dies.** Every remote connection with state in it (active sessions, pending
  requests either way) is closed with 1001 (the client reconnects, initializes, resumes and
  resends: keys still hold where the child stores its sessions durably, e.g. the reference
  agent on SQLite); connections without state stay open. The child is started again after a
  jittered, exponentially growing delay (`backoff`), reset once a child has lived
  `stable_after` seconds. Meanwhile requests wait up to `ready_timeout` for it, then get
  -32603. The first child must start and initialize, or `Bridge` raises `BridgeError`.
- **Tenants.** With tenants' tokens (`create_app(tokens=..., handler=bridge.serve)`, i.e.
  `acp-once bridge --tokens FILE`) each remote connection carries its tenant, and the child
  sees one connection for all of them, so the bridge keeps them apart: it records the tenant
  of each session a `session/new` or `session/fork` answer names, keeps only the caller's
  sessions in `session/list` answers, answers every request naming a session that is not the
  caller's (another tenant's, or one it never saw created) with -32002 as for a missing
  session, and `session/close`/`session/delete` of one with success, without forwarding any
  of them. The record lives in memory: after a restart of the bridge, older sessions belong
  to no tenant and are visible to none. Connections without a tenant see every session.
- **Limits.** Updates for a session no remote connection has active are dropped (an agent
  that sends updates before its `session/new` answer names the session loses them). The child
  never sees a remote connection end, so its sessions stay active on its one connection while
  it lives (live-only keys, R36, are kept that long). One child process is one agent's
  capacity: the bridge adds connections, not parallelism.

The package: `supervisor` runs the child (spawn, initialize, restart with backoff),
`translation` keeps the ids per hop, `routing` the sessions per remote connection, and
`proxy.Bridge` puts them together.
"""

from .proxy import Bridge
from .supervisor import DEFAULT_BACKOFF, BridgeError

__all__ = ["DEFAULT_BACKOFF", "Bridge", "BridgeError"]
