"""The server's limits and timeouts as values (`ServerLimits`, `ServerTimeouts`): what
`create_app` takes, what its single keywords replace, and where `acp-once serve` gets its
defaults; and `--forwarded-allow-ips` checked on the command line."""

from __future__ import annotations

import subprocess
import sys

import pytest

from acp_once.server import ServerLimits, ServerTimeouts, create_app
from acp_once.support.server_options import DEFAULT_SSE_KEEPALIVE
from acp_once.transports import http


def _handler_app(**kwargs: object) -> object:
    async def handler(frames: object, name: str, tenant: str | None) -> None:
        return None

    return create_app(None, handler=handler, **kwargs)  # type: ignore[arg-type]


def test_create_app_takes_the_values_and_single_keywords_replace_fields() -> None:
    app = _handler_app(
        limits=ServerLimits(max_connections=7, max_unopened_http_per_address=2),
        timeouts=ServerTimeouts(idle=None, write=3.0),
        max_message_bytes=1234,
        body_timeout=4.0,
    )
    acp = app.state.acp  # type: ignore[attr-defined]
    assert acp.limits == ServerLimits(
        max_connections=7, max_message_bytes=1234, max_unopened_http_per_address=2
    )
    assert acp.timeouts == ServerTimeouts(idle=None, write=3.0, body=4.0)
    assert (acp.max_connections, acp.idle_timeout, acp.write_timeout) == (7, None, 3.0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_connections": 0},
        {"max_unopened_http_per_tenant": 0},
        {"idle_timeout": 0},
        {"body_timeout": -1.0},
        {"forwarded_allow_ips": ["not-an-address"]},
    ],
)
def test_a_bad_limit_timeout_or_proxy_is_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        _handler_app(**kwargs)


def test_an_unknown_option_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="max_conections"):
        _handler_app(max_conections=3)


def test_the_defaults_are_the_transports_and_the_clis() -> None:
    assert ServerTimeouts().sse_keepalive == DEFAULT_SSE_KEEPALIVE == http.DEFAULT_SSE_KEEPALIVE
    result = subprocess.run(
        [sys.executable, "-m", "acp_once", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
        env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"},
    )
    assert "--forwarded-allow-ips" in result.stdout
    assert "10000" in result.stdout.replace(",", "")  # ServerLimits().max_connections


def test_serve_refuses_a_proxy_that_is_not_an_address() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "acp_once", "serve", "--forwarded-allow-ips", "10.0.0.1,proxy"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 2
    assert "proxy" in result.stderr and "--forwarded-allow-ips" in result.stderr
