// The ACP TypeScript SDK 2.4.0's stable (v1) client, its main entry (`client()`, `ndJsonStream`),
// against an agent it spawns over stdio. Driven by tests/interop/test_ts_v1_client.py.
//
//   node ts_v1_client.mjs CWD COMMAND ARGS...
//
// It initializes with the SDK's PROTOCOL_VERSION (1), starts a session in CWD, sends one prompt
// ("hello [tool]") and reads the session's messages until the turn stops. Prints one JSON
// object: the initialize result, the session id, every update it read and the stop reason.

import * as acp from "@agentclientprotocol/sdk";
import { spawn } from "node:child_process";
import { Readable, Writable } from "node:stream";

const [cwd, ...command] = process.argv.slice(2);
if (!cwd || command.length === 0) {
  console.error("usage: node ts_v1_client.mjs CWD COMMAND ARGS...");
  process.exit(2);
}
const TIMEOUT_MS = 20_000;
setTimeout(() => {
  console.error("timed out");
  process.exit(3);
}, TIMEOUT_MS).unref();

const child = spawn(command[0], command.slice(1), { stdio: ["pipe", "pipe", "inherit"] });
const stream = acp.ndJsonStream(Writable.toWeb(child.stdin), Readable.toWeb(child.stdout));

const report = await acp.client().connectWith(stream, async (agent) => {
  const init = await agent.request("initialize", {
    protocolVersion: acp.PROTOCOL_VERSION,
    clientCapabilities: {},
    clientInfo: { name: "ts-sdk-v1-client", version: "2.4.0" },
  });
  return agent.buildSession(cwd).withSession(async (session) => {
    const updates = [];
    const answered = session.prompt("hello [tool]");
    for (;;) {
      const message = await session.nextUpdate();
      if (message.kind === "stop") {
        await answered;
        return { init, sessionId: session.sessionId, updates, stopReason: message.stopReason };
      }
      updates.push(message.update);
    }
  });
});
console.log(JSON.stringify(report));
child.stdin.end();
child.kill();
process.exit(0);
