"""`serve`'s acceptor (`acp_once.server.listen._Acceptor`): every connection waiting in the
backlog is accepted each time the listening socket is ready, not one per turn of the loop (as
uvloop's libuv does); a process out of file descriptors pauses and tries again."""

from __future__ import annotations

import asyncio
import errno
import importlib
import socket

import anyio
import pytest

from acp_once.server.listen import _Acceptor  # pyright: ignore[reportPrivateUsage]
from tests.remote.harness import listening_socket

pytestmark = pytest.mark.anyio

TIMEOUT = 20.0


class _Counting(asyncio.Protocol):
    """Says "hi" on each connection; `all_made` is set once `expected` connections are made."""

    made = 0
    expected = 0
    all_made: asyncio.Event

    @classmethod
    def expect(cls, n: int) -> None:
        cls.made, cls.expected, cls.all_made = 0, n, asyncio.Event()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.write(b"hi")
        _Counting.made += 1
        if _Counting.made >= _Counting.expected:
            _Counting.all_made.set()


def _connect(port: int, n: int) -> list[socket.socket]:
    """`n` client connections, established by the kernel (in the backlog, not accepted)."""
    clients = []
    for _ in range(n):
        client = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
        clients.append(client)
    return clients


async def test_every_waiting_connection_is_accepted_at_once() -> None:
    loop = asyncio.get_running_loop()
    sock = listening_socket()
    _Counting.expect(40)
    clients = _connect(sock.getsockname()[1], 40)
    acceptor = _Acceptor(sock, _Counting, loop)
    try:
        acceptor._accept()  # one readiness event  # pyright: ignore[reportPrivateUsage]
        with anyio.fail_after(TIMEOUT):
            await _Counting.all_made.wait()  # the hand-overs run on the next turns
        with pytest.raises(BlockingIOError):  # nothing left in the backlog
            sock.accept()
        for client in clients:  # each got its own protocol, answering
            assert client.recv(2) == b"hi"
    finally:
        acceptor.stop()
        for client in clients:
            client.close()
        sock.close()


async def test_out_of_file_descriptors_pauses_then_accepts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    loop = asyncio.get_running_loop()
    monkeypatch.setattr(importlib.import_module("acp_once.server.listen"), "_ACCEPT_RETRY_S", 0.05)
    real = listening_socket()
    _Counting.expect(3)
    failures = [OSError(errno.EMFILE, "Too many open files")]

    class _Flaky:
        """The listening socket, whose first accept fails as at the descriptor limit."""

        def fileno(self) -> int:
            return real.fileno()

        def setblocking(self, flag: bool) -> None:
            real.setblocking(flag)

        def accept(self) -> tuple[socket.socket, object]:
            if failures:
                raise failures.pop()
            return real.accept()

    clients = _connect(real.getsockname()[1], 3)
    acceptor = _Acceptor(_Flaky(), _Counting, loop)  # type: ignore[arg-type]
    try:
        acceptor.start()
        with anyio.fail_after(TIMEOUT):
            await _Counting.all_made.wait()  # after the pause
        assert not failures
    finally:
        acceptor.stop()
        for client in clients:
            client.close()
        real.close()
