"""What the fuzz suite looks for in a process's log: no ERROR and no traceback."""

from __future__ import annotations


def assert_clean(log: str) -> None:
    """No ERROR and no traceback in `log`: a client's mistakes are warnings at most."""
    assert "Traceback" not in log and "ERROR" not in log, log[-3000:]
