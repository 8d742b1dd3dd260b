"""A scripted model for Codex: a loopback HTTP server that speaks the streamed OpenAI Responses
API (`POST /v1/responses`, server-sent events), enough for codex-acp to run whole turns offline.

The script is in the user's words, so that a turn is the same whichever process sends it (a
retry, a restarted agent) and the server keeps no state but its log. The last user message
decides:

- `run: CMD`: the model calls `exec_command {"cmd": CMD}`, then, once the request carries the
  call's output, answers `ran: CMD`;
- `run+block: CMD`: the same, but the answer after the call stalls as `block` does (a turn
  whose side effect is done, still running);
- `patch:` followed by an `apply_patch` patch: the model calls the `apply_patch` custom tool,
  then answers `patched`;
- `block`: the answer stalls after `response.created` until `release()` is called or the
  client goes away (a turn to cancel, or to hold another behind);
- anything else: the answer is `ok: TEXT`.

Every request body is kept in `requests` (and appended to `log_path` as one JSON line when
given). The server listens on 127.0.0.1 only.
"""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Self

__all__ = ["ModelServer", "codex_home", "user_texts"]

MODEL = "gpt-5.4-mini"  # in Codex's own catalog: an unknown name makes it warn as agent text
API_KEY_ENV = "ACP_ONCE_TEST_MODEL_KEY"
BLOCK_LIMIT = 60.0  # seconds a blocked answer waits for release() at most


def user_texts(body: dict[str, Any]) -> list[str]:
    """The texts of the user messages in a request's `input`, in order."""
    return [
        part["text"]
        for item in body.get("input", [])
        if item.get("type") == "message" and item.get("role") == "user"
        for part in item.get("content", [])
        if part.get("type") == "input_text"
    ]


def _last_user_index(items: list[dict[str, Any]]) -> int:
    for i in range(len(items) - 1, -1, -1):
        item = items[i]
        if item.get("type") == "message" and item.get("role") == "user":
            return i
    return -1


class ModelServer:
    """The server, for `with`: started on entry (on a free port), stopped on exit.

    Attributes:
        requests: every request body received, in order.
        base_url: `http://127.0.0.1:PORT/v1`, for Codex's `base_url`.
    """

    def __init__(self, log_path: Path | None = None, *, port: int = 0) -> None:
        self.requests: list[dict[str, Any]] = []
        self.log_path = log_path
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._release = threading.Event()
        self.blocked = threading.Event()
        """Set when an answer has started to stall on `block`."""
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass  # requests are logged as JSON instead

            def do_POST(self) -> None:
                length = int(self.headers.get("content-length", "0"))
                body = json.loads(self.rfile.read(length) or b"{}")
                server._log(body)
                if not self.path.endswith("/responses"):
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.send_header("connection", "close")
                self.end_headers()
                self.close_connection = True
                try:
                    for event in server._answer(body):
                        data = json.dumps(event)
                        self.wfile.write(f"event: {event['type']}\ndata: {data}\n\n".encode())
                        self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client went away (a cancelled turn)

        self._httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self._httpd.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self._httpd.server_address[1]}/v1"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._release.set()
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=10)

    def release(self) -> None:
        """Let every stalled (`block`) answer, and every later one, finish."""
        self._release.set()

    def _log(self, body: dict[str, Any]) -> None:
        with self._lock:
            self.requests.append(body)
            if self.log_path is not None:
                with self.log_path.open("a", encoding="utf-8") as f:
                    f.write(json.dumps(body) + "\n")

    def _answer(self, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        n = next(self._ids)
        rid = f"resp_{n}"
        yield {"type": "response.created", "response": {"id": rid}}
        items = list(body.get("input", []))
        last = _last_user_index(items)
        texts = user_texts({"input": items[last:]}) if last >= 0 else []
        text = texts[-1].strip() if texts else ""
        after = items[last + 1 :]
        answered = any(
            i.get("type") in ("function_call_output", "custom_tool_call_output") for i in after
        )
        if text == "block" and not answered:
            self.blocked.set()
            self._release.wait(BLOCK_LIMIT)
            yield from self._message(rid, n, "released")
        elif text.startswith(("run:", "run+block:")) and not answered:
            call = {
                "type": "function_call",
                "call_id": f"call_{n}",
                "name": "exec_command",
                "arguments": json.dumps({"cmd": text.split(":", 1)[1].strip()}),
            }
            yield from self._item(call)
        elif text.startswith("run+block:"):
            self.blocked.set()
            self._release.wait(BLOCK_LIMIT)
            yield from self._message(rid, n, "released")
        elif text.startswith("patch:") and not answered:
            call = {
                "type": "custom_tool_call",
                "call_id": f"call_{n}",
                "name": "apply_patch",
                "input": text[6:].strip() + "\n",
            }
            yield from self._item(call)
        elif text.startswith("run:"):
            yield from self._message(rid, n, f"ran: {text[4:].strip()}")
        elif text.startswith("patch:"):
            yield from self._message(rid, n, "patched")
        else:
            yield from self._message(rid, n, f"ok: {text}")
        yield {
            "type": "response.completed",
            "response": {
                "id": rid,
                "usage": {
                    "input_tokens": 0,
                    "input_tokens_details": None,
                    "output_tokens": 0,
                    "output_tokens_details": None,
                    "total_tokens": 0,
                },
            },
        }

    @staticmethod
    def _item(item: dict[str, Any]) -> Iterator[dict[str, Any]]:
        yield {"type": "response.output_item.added", "item": item}
        yield {"type": "response.output_item.done", "item": item}

    @staticmethod
    def _message(rid: str, n: int, text: str) -> Iterator[dict[str, Any]]:
        mid = f"msg_{n}"
        empty = {"type": "message", "role": "assistant", "id": mid, "content": []}
        yield {"type": "response.output_item.added", "item": empty}
        for start in range(0, len(text), 8):
            delta = text[start : start + 8]
            yield {"type": "response.output_text.delta", "item_id": mid, "delta": delta}
        full = {**empty, "content": [{"type": "output_text", "text": text}]}
        yield {"type": "response.output_item.done", "item": full}


def codex_home(root: Path, base_url: str, *, approval_policy: str = "never") -> dict[str, str]:
    """Write a Codex configuration into `root` (its `CODEX_HOME`) that uses the model at
    `base_url` and nothing else; returns the environment variables to start codex-acp with."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.toml").write_text(
        f"""model = "{MODEL}"
model_provider = "scripted"
approval_policy = "{approval_policy}"
sandbox_mode = "danger-full-access"
allow_login_shell = false

[model_providers.scripted]
name = "scripted"
base_url = "{base_url}"
wire_api = "responses"
env_key = "{API_KEY_ENV}"
request_max_retries = 0
stream_max_retries = 0

[features]
shell_snapshot = false

[analytics]
enabled = false
""",
        encoding="utf-8",
    )
    return {"CODEX_HOME": str(root), API_KEY_ENV: "dummy-key"}


def main() -> None:
    """`python -m tests.codex.model_server --codex-home DIR [--port N]`: write a Codex home in
    DIR that uses this model, print the variables to start codex-acp with, serve until
    interrupted."""
    import argparse
    import contextlib
    import signal

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--codex-home", type=Path, required=True)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--approval-policy", default="never")
    parser.add_argument("--log", type=Path, default=None, help="append each request here")
    args = parser.parse_args()
    with ModelServer(args.log, port=args.port) as server:
        home = args.codex_home.resolve()
        env = codex_home(home, server.base_url, approval_policy=args.approval_policy)
        for name, value in env.items():
            print(f"export {name}={value}", flush=True)
        print(f"# the model listens on {server.base_url}; Ctrl-C stops it", flush=True)
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        with contextlib.suppress(KeyboardInterrupt):
            stop.wait()


if __name__ == "__main__":
    main()
