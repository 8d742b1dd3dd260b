from __future__ import annotations

import os

import pytest

# Every SessionAgent the tests start (in process or as a subprocess, which inherits it) refuses
# an invalid update dict instead of sending it: a malformed update fails the test that emits it.
os.environ.setdefault("ACP_ONCE_STRICT", "1")

# A code mutant's run (verification/mutate.py) puts a mutated copy of src/ first on the path:
# a run that imported the working tree instead would report the mutant caught or missed for
# code it never ran.
_MUTANT_SRC = os.environ.get("ACP_ONCE_MUTANT_SRC")
if _MUTANT_SRC:
    import acp_once

    assert acp_once.__file__ is not None
    assert acp_once.__file__.startswith(_MUTANT_SRC), (acp_once.__file__, _MUTANT_SRC)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
