"""`acp-once serve` under three hostile loads, each against a fresh server process.

(a) N half-open connections (1,500 by default: connect, send part of a request's headers,
    hold): `/healthz` latency while they are held, how many the server closed while held
    (its half-open caps close the oldest), and the time until the server has closed every one
    (its header timeout).
(b) A 512 MiB chunked POST to `/acp`: the status answered, how much was sent before the server
    stopped reading, and the rise of the server's peak RSS (VmHWM) over its RSS before.
(c) 60,000 `session/list` requests over one WebSocket whose answers are never read: how many
    the server took before it stopped reading, and its RSS then.

    python3 dev.py run python benchmarks/bench_hostile.py [--half-open N] [--body-mib N]
        [--requests N]

The server needs about one descriptor per held connection beyond ~50 of its own: the benchmark
raises its soft `ulimit -n` to the hard limit (inherited by the server) and says so.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import os
import resource
import select
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

HALF_OPEN_ADDRESSES = [f"127.0.0.{i}" for i in range(2, 10)]
"""Client addresses the held connections come from, round-robin: spread so the per-address
cap (256) is not what closes them (that a single address is capped is tested)."""
INITIALIZE = (
    b'{"jsonrpc":"2.0","id":"init","method":"initialize",'
    b'"params":{"protocolVersion":2,"info":{"name":"bench","version":"1"}}}'
)


def _status_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise LookupError(field)


def _mb(kb: int) -> str:
    return f"{kb / 1024:.0f} MB"


@contextlib.contextmanager
def serve(backlog: int) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """`acp-once serve --store memory` on a listening socket of ours (`--fd`): the port is
    known and connections wait in the backlog until the server accepts them."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    sock.listen(backlog)
    port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp, open(Path(tmp) / "stderr", "wb") as log:
        command = [
            sys.executable, "-m", "acp_once", "serve", "--store", "memory",
            "--side-effects", tmp, "--fd", str(sock.fileno()),
        ]  # fmt: skip
        proc = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=log, stderr=log, pass_fds=(sock.fileno(),)
        )
        sock.close()
        try:
            healthz(port, timeout=30)  # started
            yield proc, port
        finally:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def healthz(port: int, timeout: float) -> float:
    """Seconds until GET /healthz is answered 200 on a new connection."""
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        head = b""
        while b"\r\n" not in head:
            chunk = s.recv(4096)
            if not chunk:
                raise EOFError("closed before answering")
            head += chunk
    assert head.startswith(b"HTTP/1.1 200"), head[:80]
    return time.monotonic() - start


def _open(sockets: list[socket.socket], wait: float = 0) -> list[socket.socket]:
    """Those of `sockets` the server has not closed yet (EOF or a reset), after waiting up to
    `wait` seconds for one to change (poll: descriptors beyond select's 1,024)."""
    poller = select.poll()
    for s in sockets:
        poller.register(s, select.POLLIN)
    readable = {fd for fd, _ in poller.poll(wait * 1000)}
    still = []
    for s in sockets:
        if s.fileno() in readable:
            try:
                if s.recv(4096):
                    still.append(s)  # an answer (e.g. 408) precedes the close: look again
                    continue
            except OSError:
                pass
            s.close()
        else:
            still.append(s)
    return still


def half_open(n: int) -> None:
    with serve(backlog=4096) as (proc, port):
        held: list[socket.socket] = []
        start = time.monotonic()
        for i in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((HALF_OPEN_ADDRESSES[i % len(HALF_OPEN_ADDRESSES)], 0))
            s.connect(("127.0.0.1", port))
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            held.append(s)
        opened = time.monotonic() - start
        latencies = [healthz(port, timeout=30) for _ in range(5)]
        held = _open(held)
        print(
            f"(a) {n} half-open connections opened in {opened:.1f} s from "
            f"{len(HALF_OPEN_ADDRESSES)} addresses; /healthz while held: max "
            f"{max(latencies):.3f} s, median {sorted(latencies)[2]:.3f} s (target <= 3 s); "
            f"{n - len(held)} closed by the caps by then; "
            f"server RSS {_mb(_status_kb(proc.pid, 'VmRSS'))}"
        )
        deadline = time.monotonic() + 120
        while held and time.monotonic() < deadline:
            held = _open(held, wait=0.5)  # wakes when the server closes one
        all_closed = time.monotonic() - start
        print(
            f"    all closed by the server {all_closed:.1f} s after the first was opened "
            f"({len(held)} still open; target <= 40 s); /healthz then: "
            f"{healthz(port, timeout=30):.3f} s"
        )
        for s in held:
            s.close()


def big_body(mib: int) -> None:
    with serve(backlog=128) as (proc, port):
        before = _status_kb(proc.pid, "VmRSS")
        chunk = b"x" * (1 << 20)
        frame = b"%x\r\n%s\r\n" % (len(chunk), chunk)
        sent = 0
        status = b"(none)"
        start = time.monotonic()
        with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
            s.sendall(
                b"POST /acp HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Accept: application/json, text/event-stream\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n"
            )
            try:
                for _ in range(mib):
                    s.sendall(frame)
                    sent += 1
                    if select.select([s], [], [], 0)[0]:
                        break  # answered: the server stopped reading
                s.sendall(b"0\r\n\r\n")
            except OSError:
                pass  # closed by the server mid-body
            with contextlib.suppress(OSError):
                status = s.recv(4096).split(b"\r\n", 1)[0]
        elapsed = time.monotonic() - start
        peak = _status_kb(proc.pid, "VmHWM")
        print(
            f"(b) a {mib} MiB chunked POST: answered {status.decode(errors='replace')!r} after "
            f"{sent} MiB sent in {elapsed:.1f} s; server RSS before {_mb(before)}, peak "
            f"{_mb(peak)}: rise {_mb(peak - before)} (target <= ~100 MB); "
            f"/healthz {healthz(port, timeout=30):.3f} s"
        )


def _ws_frame(payload: bytes) -> bytes:
    """A masked text frame (a client's frames are masked; a zero mask leaves the payload)."""
    n = len(payload)
    if n < 126:
        head = bytes([0x81, 0x80 | n])
    elif n < 1 << 16:
        head = bytes([0x81, 0x80 | 126]) + n.to_bytes(2, "big")
    else:
        head = bytes([0x81, 0x80 | 127]) + n.to_bytes(8, "big")
    return head + b"\0\0\0\0" + payload


def unread(requests: int, stall: float) -> None:
    with serve(backlog=128) as (proc, port):
        before = _status_kb(proc.pid, "VmRSS")
        s = socket.create_connection(("127.0.0.1", port), timeout=30)
        key = base64.b64encode(os.urandom(16))
        s.sendall(
            b"GET /acp HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
            b"Connection: Upgrade\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: %s\r\n\r\n"
            % key
        )
        head = b""
        while b"\r\n\r\n" not in head:
            head += s.recv(4096)
        assert head.startswith(b"HTTP/1.1 101"), head[:80]
        s.sendall(_ws_frame(INITIALIZE))
        s.setblocking(False)
        pending = b"".join(
            _ws_frame(b'{"jsonrpc":"2.0","id":%d,"method":"session/list"}' % i)
            for i in range(requests)
        )
        total, sent = len(pending), 0
        view = memoryview(pending)
        last = time.monotonic()
        while sent < total and time.monotonic() - last < stall:
            if not select.select([], [s], [], 0.2)[1]:
                continue
            try:
                n = s.send(view[sent : sent + (1 << 16)])
            except BlockingIOError:
                continue
            sent += n
            last = time.monotonic()
        taken = requests * sent // total
        # the server works through what it took for a while yet: its highest RSS over the
        # next `stall` seconds
        rss, settle = 0, time.monotonic() + stall
        while time.monotonic() < settle:
            rss = max(rss, _status_kb(proc.pid, "VmRSS"))
            time.sleep(0.1)  # sampling another process's memory, not synchronising
        peak = _status_kb(proc.pid, "VmHWM")
        how = "all" if sent == total else f"it stalled {stall:.0f} s"
        print(
            f"(c) {requests} session/list over one WebSocket, answers unread: ~{taken} written "
            f"({how}); server RSS before {_mb(before)}, highest in the next {stall:.0f} s "
            f"{_mb(rss)}, peak {_mb(peak)} "
            f"(target <= ~200 MB); /healthz {healthz(port, timeout=30):.3f} s"
        )
        s.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--half-open", type=int, default=1500)
    parser.add_argument("--body-mib", type=int, default=512)
    parser.add_argument("--requests", type=int, default=60_000)
    parser.add_argument("--stall", type=float, default=3.0)
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = args.half_open + 100  # the held sockets, here and in the server, and spare
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(need, soft)), hard))
    now = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    print(
        f"ulimit -n: {soft} -> {now} (the server inherits it; it needs ~{args.half_open + 50} "
        "for the held connections and its own)"
    )
    half_open(args.half_open)
    big_body(args.body_mib)
    unread(args.requests, args.stall)


if __name__ == "__main__":
    main()
