"""Golden wire messages: each validates with its model and dumps back to the same JSON.

The file format is described in `tests/protocol/golden/README.md`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel, RootModel

from acp_once.protocol import schema
from acp_once.protocol.retry import Direction, MessageKind, lookup

GOLDEN = Path(__file__).resolve().parent / "golden"
UNSTABLE_SCHEMA = Path(__file__).resolve().parents[2] / "schema" / "schema.unstable.json"
FORMAT_KEYS = {"method", "direction", "kind", "model", "message"}
KINDS = {"request", "notification", "result", "error"}
DIRECTIONS = {Direction.CLIENT_TO_AGENT.value, Direction.AGENT_TO_CLIENT.value}

# The message kinds the project uses; deleting one of these files must fail a test.
REQUIRED = {
    "initialize.request",
    "initialize.result",
    "session_new.request",
    "session_new.result",
    "session_list.request",
    "session_list.result",
    "session_resume.request",
    "session_resume.request.replay_from",
    "session_resume.result",
    "session_close.request",
    "session_close.result",
    "session_delete.request",
    "session_delete.result",
    "session_fork.request",
    "session_fork.result",
    "session_prompt.request.key",
    "session_prompt.request.key_null",
    "session_prompt.request.key_absent",
    "session_prompt.result",
    "session_cancel.notification",
    "cancel_request.notification",
    "session_update.user_message",
    "session_update.user_message_chunk",
    "session_update.agent_message",
    "session_update.agent_message_chunk",
    "session_update.state_update.running",
    "session_update.state_update.idle_end_turn",
    "session_update.state_update.idle_cancelled",
    "session_update.state_update.idle_error",
    "session_update.tool_call_update",
    "session_update.available_commands_update",
    "session_request_permission.request",
    "session_request_permission.result.selected",
    "session_request_permission.result.cancelled",
    "error.invalid_params",
    "error.session_not_found",
    "error.unsupported_protocol_version",
    "error.request_cancelled",
}

FILES = sorted(GOLDEN.glob("*.json"))


def _load(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return data


def _model(golden: dict[str, Any]) -> type[BaseModel]:
    model = getattr(schema, golden["model"])
    assert isinstance(model, type)
    assert issubclass(model, BaseModel)
    return model


def _dump(instance: BaseModel) -> Any:
    return instance.model_dump(mode="json", by_alias=True, exclude_unset=True)


def _ids(path: Path) -> str:
    return path.stem


def test_every_required_message_kind_has_a_golden_file() -> None:
    present = {path.stem for path in FILES}
    assert not REQUIRED - present, f"missing golden files: {sorted(REQUIRED - present)}"


@pytest.mark.parametrize("path", FILES, ids=_ids)
def test_golden_file_format(path: Path) -> None:
    golden = _load(path)
    assert set(golden) == FORMAT_KEYS
    assert golden["direction"] in DIRECTIONS
    assert golden["kind"] in KINDS
    assert isinstance(golden["message"], dict)
    prefix = "error" if golden["kind"] == "error" else golden["method"].lstrip("$/")
    assert path.stem.startswith(prefix.replace("/", "_") + "."), (
        "see tests/protocol/golden/README.md"
    )


@pytest.mark.parametrize("path", FILES, ids=_ids)
def test_golden_model_exists(path: Path) -> None:
    golden = _load(path)
    assert golden["model"] in schema.__dict__, f"{golden['model']} is not in protocol.schema"
    _model(golden)


@pytest.mark.parametrize("path", FILES, ids=_ids)
def test_golden_round_trip_is_exact(path: Path) -> None:
    golden = _load(path)
    instance = _model(golden).model_validate(golden["message"])
    assert _dump(instance) == golden["message"]
    # And the dump is a fixed point: validating it again changes nothing.
    assert _dump(_model(golden).model_validate(_dump(instance))) == golden["message"]


@pytest.mark.parametrize("path", FILES, ids=_ids)
def test_golden_method_and_direction_are_real(path: Path) -> None:
    golden = _load(path)
    direction = Direction(golden["direction"])
    if golden["kind"] in ("request", "notification"):
        assert lookup(golden["method"], MessageKind(golden["kind"]), direction) is not None
    else:
        # A response answers a request that travelled the other way.
        request_direction = (
            Direction.AGENT_TO_CLIENT
            if direction is Direction.CLIENT_TO_AGENT
            else Direction.CLIENT_TO_AGENT
        )
        assert lookup(golden["method"], MessageKind.REQUEST, request_direction) is not None
    definition = json.loads(UNSTABLE_SCHEMA.read_text(encoding="utf-8"))["$defs"].get(
        golden["model"], {}
    )
    if "x-method" in definition:
        assert definition["x-method"] == golden["method"]


def _undeclared(value: Any, where: str) -> list[str]:
    """Where the parsed message is not fully typed.

    That is every wire field no model declares (kept only as an `extra="allow"` extra) and
    every value parsed into a "custom or future" fallback variant (`...Other`).
    """
    if isinstance(value, RootModel):
        return _undeclared(value.root, where)
    if isinstance(value, BaseModel):
        found = [f"{where}.{key}" for key in value.model_extra or {}]
        fallbacks = [cls.__name__ for cls in type(value).__mro__ if cls.__name__.endswith("Other")]
        found += [f"{where} is {name}" for name in fallbacks]
        for name in type(value).model_fields:
            found += _undeclared(getattr(value, name), f"{where}.{name}")
        return found
    if isinstance(value, list):
        return [
            item
            for i, element in enumerate(value)
            for item in _undeclared(element, f"{where}[{i}]")
        ]
    # Dicts are free-form values (`_meta`, `rawInput`, error `data`): not checked.
    return []


@pytest.mark.parametrize("path", FILES, ids=_ids)
def test_golden_fields_are_declared(path: Path) -> None:
    # The models allow extra fields, so a misspelt field would round-trip unnoticed.
    golden = _load(path)
    instance = _model(golden).model_validate(golden["message"])
    assert _undeclared(instance, "message") == []


def _prompt(name: str) -> tuple[dict[str, Any], schema.PromptRequest]:
    golden = _load(GOLDEN / f"{name}.json")
    return golden["message"], schema.PromptRequest.model_validate(golden["message"])


def test_prompt_key_present_null_and_absent() -> None:
    wire, request = _prompt("session_prompt.request.key")
    assert request.idempotency_key == wire["idempotencyKey"]
    wire, request = _prompt("session_prompt.request.key_null")
    assert wire["idempotencyKey"] is None
    assert request.idempotency_key is None
    assert _dump(request)["idempotencyKey"] is None
    wire, request = _prompt("session_prompt.request.key_absent")
    assert "idempotencyKey" not in wire
    assert request.idempotency_key is None
    assert "idempotencyKey" not in _dump(request)


@pytest.mark.parametrize(
    ("name", "code", "data_model"),
    [
        ("error.invalid_params", -32602, None),
        ("error.session_not_found", -32002, schema.SessionNotFoundErrorData),
        ("error.unsupported_protocol_version", -32022, schema.UnsupportedProtocolVersionErrorData),
        ("error.request_cancelled", -32800, None),
    ],
)
def test_error_data_shapes(name: str, code: int, data_model: type[BaseModel] | None) -> None:
    error = schema.Error.model_validate(_load(GOLDEN / f"{name}.json")["message"])
    assert error.code == code
    if data_model is not None:
        assert isinstance(error.data, data_model)
    else:
        assert not isinstance(
            error.data, schema.SessionNotFoundErrorData | schema.UnsupportedProtocolVersionErrorData
        )


def test_permission_outcomes_are_told_apart() -> None:
    selected = schema.RequestPermissionResponse.model_validate(
        _load(GOLDEN / "session_request_permission.result.selected.json")["message"]
    )
    cancelled = schema.RequestPermissionResponse.model_validate(
        _load(GOLDEN / "session_request_permission.result.cancelled.json")["message"]
    )
    assert isinstance(selected.outcome, schema.SelectedPermissionOutcome)
    assert selected.outcome.option_id == "allow-once"
    assert isinstance(cancelled.outcome, schema.CancelledPermissionOutcome)


def test_idle_state_update_is_typed_not_unknown() -> None:
    """An idle update parses as the idle state with its stop reason and error, not as a
    catch-all unknown state (the generator needs the schema's idle variants flattened)."""
    notification = schema.UpdateSessionNotification.model_validate(
        {
            "sessionId": "sess_1",
            "update": {
                "sessionUpdate": "state_update",
                "state": "idle",
                "stopReason": "error",
                "error": {"code": -32603, "message": "The turn failed"},
            },
        }
    )
    update = notification.update
    assert isinstance(update, schema.StateUpdateIdle)
    assert update.stop_reason == "error"
    assert update.error is not None and update.error.code == -32603
