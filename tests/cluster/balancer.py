"""HAProxy in front of `acp-once serve` nodes, for tests and benchmarks: a real `haproxy`
process (Debian's package) run with the documented configuration, examples/haproxy.cfg, whose
addresses are replaced by the test's (the frontend's inherited listening socket, the nodes'
ports) and to which a stats socket is added (`Balancer.servers` reads it)."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import anyio.abc
import httpx
import pytest

from tests.cluster.harness import until_async

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "haproxy.cfg"
FRONT = "127.0.0.1:8700"
"""The frontend address in examples/haproxy.cfg."""
NODES = {"n1": "127.0.0.1:8701", "n2": "127.0.0.1:8702", "n3": "127.0.0.1:8703"}
"""The nodes in examples/haproxy.cfg: node id -> address."""


def haproxy_binary() -> str:
    """The `haproxy` executable; skips without one, and fails instead when CI is "true" (.ci/run
    installs Debian's package)."""
    found = shutil.which("haproxy") or next(
        (p for p in ("/usr/sbin/haproxy", "/usr/local/sbin/haproxy") if os.access(p, os.X_OK)),
        None,
    )
    if found is None:
        reason = "haproxy is not installed (apt-get install haproxy)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true requires the load balancer tests: {reason}")
        pytest.skip(reason)
    return found


def render(front_fd: int, ports: Sequence[int], stats: Path) -> str:
    """examples/haproxy.cfg with the frontend on the inherited socket `front_fd`, node nK on
    127.0.0.1:`ports[K-1]` and an admin stats socket at `stats`; nothing else changes."""
    if len(ports) != len(NODES):
        raise ValueError(f"the example configures {len(NODES)} nodes")
    config = EXAMPLE.read_text(encoding="utf-8")
    replacements = {f"bind {FRONT}\n": f"bind fd@{front_fd}\n"}
    for (name, address), port in zip(NODES.items(), ports, strict=True):
        replacements[f"server {name} {address}\n"] = f"server {name} 127.0.0.1:{port}\n"
    replacements["global\n"] = f"global\n    stats socket {stats} mode 600 level admin\n"
    for old, new in replacements.items():
        if config.count(old) != 1:
            raise ValueError(f"examples/haproxy.cfg: expected {old!r} once")
        config = config.replace(old, new)
    return config


class Balancer:
    """A running haproxy (see `balancer`)."""

    def __init__(self, port: int, stats: Path) -> None:
        self.port = port
        self.stats = stats

    @property
    def ws(self) -> str:
        return f"ws://127.0.0.1:{self.port}/acp"

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}/acp"

    async def servers(self) -> dict[str, str]:
        """Each server's state as haproxy sees it now ("UP", "DOWN", ...), by name."""
        stream = await anyio.connect_unix(str(self.stats))
        async with stream:
            await stream.send(b"show stat\n")
            chunks = []
            with anyio.fail_after(5):
                while True:
                    try:
                        chunks.append(await stream.receive())
                    except anyio.EndOfStream:
                        break
        lines = b"".join(chunks).decode().splitlines()
        header = lines[0].lstrip("# ").split(",")
        name, status = header.index("svname"), header.index("status")
        return {
            row[name]: row[status].split()[0]
            for row in (line.split(",") for line in lines[1:] if line)
            if row[0] == "nodes" and row[name] not in ("FRONTEND", "BACKEND")
        }

    async def until(self, name: str, state: str) -> None:
        """Wait until haproxy sees server `name` in `state` (bound it with fail_after): its
        health checks on /healthz decide."""

        async def seen() -> bool:
            return (await self.servers()).get(name) == state

        await until_async(seen)


@asynccontextmanager
async def balancer(tmp: Path, ports: Sequence[int]) -> AsyncIterator[Balancer]:
    """haproxy with the documented configuration in front of nodes n1..n3 on `ports`, once it
    answers and sees every node UP; stopped (SIGKILL) on exit."""
    binary = haproxy_binary()
    front = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    front.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    front.bind(("127.0.0.1", 0))
    front.listen(512)
    stats = tmp / "haproxy.sock"
    config = tmp / "haproxy.cfg"
    config.write_text(render(front.fileno(), ports, stats), encoding="utf-8")
    log = tmp / "haproxy.log"
    process: anyio.abc.Process | None = None
    try:
        with open(log, "ab") as out:  # noqa: ASYNC230
            # -db: in the foreground, not as a daemon (its exit ends the test's fixture)
            process = await anyio.open_process(
                [binary, "-db", "-f", str(config)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                pass_fds=(front.fileno(),),
            )
        lb = Balancer(front.getsockname()[1], stats)
        with anyio.fail_after(30):
            while not stats.exists():
                if process.returncode is not None:
                    raise RuntimeError(f"haproxy exited: {log.read_text(errors='replace')}")
                await anyio.sleep(0.05)
            for name in NODES:
                await lb.until(name, "UP")
            async with httpx.AsyncClient() as http:

                async def answers() -> bool:
                    response = await http.get(f"http://127.0.0.1:{lb.port}/healthz")
                    return response.status_code == 200

                await until_async(answers)
        yield lb
    finally:
        front.close()
        if process is not None:
            with anyio.CancelScope(shield=True):
                if process.returncode is None:
                    process.kill()
                await process.wait()


def connection_node(connection_id: str) -> str | None:
    """The node id an `Acp-Connection-Id` begins with (`n1.…` -> "n1"), or None."""
    match = re.fullmatch(r"([A-Za-z0-9_-]+)\.[0-9a-f]{32}", connection_id)
    return match.group(1) if match else None
