from __future__ import annotations

import pytest

from acp_once.protocol.errors import InvalidRequest, UnsupportedProtocolVersion
from acp_once.protocol.initialization import InitializeGate, negotiate_version


def test_requests_before_initialize_are_refused_without_changing_state() -> None:
    gate = InitializeGate()
    with pytest.raises(InvalidRequest):
        gate.admit_request("session/new")
    gate.admit_request("initialize")
    gate.initialize_done(True)
    gate.admit_request("session/new")


def test_initialize_in_flight_refuses_everything_else() -> None:
    gate = InitializeGate()
    gate.admit_request("initialize")
    with pytest.raises(InvalidRequest):
        gate.admit_request("initialize")
    with pytest.raises(InvalidRequest):
        gate.admit_request("session/list")
    gate.initialize_done(False)
    assert not gate.initialized
    gate.admit_request("initialize")
    gate.initialize_done(True)
    assert gate.initialized


def test_repeat_initialize_allowed_until_first_other_request() -> None:
    gate = InitializeGate()
    gate.admit_request("initialize")
    gate.initialize_done(True)
    gate.admit_request("initialize")
    gate.initialize_done(False)  # a failed repeat keeps the earlier initialization
    assert gate.initialized
    gate.admit_request("session/new")
    with pytest.raises(InvalidRequest):
        gate.admit_request("initialize")


def test_notifications_before_initialize_are_ignored_except_cancel_request() -> None:
    gate = InitializeGate()
    assert gate.admit_notification("$/cancel_request")
    assert not gate.admit_notification("session/cancel")
    gate.admit_request("initialize")
    gate.initialize_done(True)
    assert gate.admit_notification("session/cancel")
    # notifications never lock initialize
    gate.admit_request("initialize")


def test_version_negotiation() -> None:
    assert negotiate_version(2, [1, 2]) == 2
    assert negotiate_version(7, [1, 2]) == 2
    assert negotiate_version(1, [1, 2]) == 1
    with pytest.raises(UnsupportedProtocolVersion) as info:
        negotiate_version(1, [2])
    assert info.value.data == {"requested": 1, "supported": [2]}
    assert info.value.code == -32022


def test_admitted_initialize_returns_the_callback_that_records_its_outcome() -> None:
    gate = InitializeGate()
    done = gate.admit_request("initialize")
    assert done is not None
    done(True)
    assert gate.initialized
    assert gate.admit_request("session/new") is None
