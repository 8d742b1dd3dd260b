from __future__ import annotations

import os

import pytest

# Every SessionAgent the tests start (in process or as a subprocess, which inherits it) refuses
# an invalid update dict instead of sending it: a malformed update fails the test that emits it.
os.environ.setdefault("ACP_ONCE_STRICT", "1")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
