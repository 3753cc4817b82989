"""`batchrun doctor`'s checks against simulated servers with and without each feature."""

from __future__ import annotations

import pytest

from batchrun.config import resolve
from batchrun.doctor import Check, diagnose, ready, render
from batchrun.sim import SimConfig, SimModel, SimTransport


async def _checks(config: SimConfig, **spec: object) -> dict[str, tuple[bool | None, str]]:
    found = await diagnose(
        resolve({"base_url": "http://sim.test/v1", **spec}), SimTransport(SimModel(config))
    )
    assert render(found)
    return {c.name: (c.ok, c.detail) for c in found}


@pytest.mark.anyio
async def test_a_full_featured_server_passes_every_check() -> None:
    checks = await _checks(SimConfig())
    assert all(ok for ok, _ in checks.values()), checks
    assert list(checks) == [
        "reachable",
        "API key",
        "model",
        "chat",
        "usage (not streamed)",
        "streaming",
        "usage (streamed)",
        "completions",
        "JSON schema",
        "server load",
    ]
    assert checks["JSON schema"][1] == "accepted and enforced (json_schema)"
    assert checks["server load"][1] == "vllm: 0 running, 0 waiting"


@pytest.mark.anyio
async def test_a_server_without_load_pages_is_said_but_not_failed() -> None:
    found = await diagnose(
        resolve({"base_url": "http://sim.test/v1"}),
        SimTransport(SimModel(SimConfig(metrics=False))),
    )
    load = next(c for c in found if c.name == "server load")
    assert load.ok is None and load.detail.startswith("none published (HTTP 404; HTTP 404)")
    assert ready(found)
    fixed = await _checks(SimConfig(), concurrency=8)  # a fixed level reads no load
    assert "server load" not in fixed


@pytest.mark.anyio
async def test_a_key_variable_named_but_not_set_is_said(monkeypatch: pytest.MonkeyPatch) -> None:
    # The server answered without a key; the user named a variable that is not set here, so
    # the job would send none either: said, so a typo in the name is seen before a night.
    monkeypatch.delenv("BATCHRUN_DOCTOR_UNSET", raising=False)
    checks = await _checks(SimConfig(), api_key_env="BATCHRUN_DOCTOR_UNSET")
    assert checks["API key"] == (
        True,
        "none sent (BATCHRUN_DOCTOR_UNSET is not set; none needed here)",
    )
    monkeypatch.setenv("BATCHRUN_DOCTOR_UNSET", "sk-local-0123456789")
    checks = await _checks(SimConfig(), api_key_env="BATCHRUN_DOCTOR_UNSET")
    assert checks["API key"] == (True, "accepted (BATCHRUN_DOCTOR_UNSET)")


@pytest.mark.anyio
async def test_a_server_refusing_response_format_is_reported_but_still_ready() -> None:
    refusing = SimTransport(SimModel(SimConfig(refuse_response_format=True)))
    found = await diagnose(resolve({"base_url": "http://sim.test/v1"}), refusing)
    checks = {c.name: c for c in found}
    assert checks["JSON schema"].ok is False and "refused" in checks["JSON schema"].detail
    assert ready(found)


@pytest.mark.anyio
async def test_a_wrong_key_and_an_unknown_model_are_not_ready(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("DOCTOR_KEY", "wrong-key-123")
    found = await diagnose(
        resolve({"base_url": "http://sim.test/v1", "api_key_env": "DOCTOR_KEY"}),
        SimTransport(SimModel(SimConfig(api_key="right-key-456"))),
    )
    assert [(c.name, c.ok) for c in found] == [("reachable", True), ("API key", False)]
    assert not ready(found)
    assert "wrong-key-123" not in render(found)
    found = await diagnose(
        resolve({"base_url": "http://sim.test/v1", "model": "nope"}),
        SimTransport(SimModel(SimConfig(strict_models=True))),
    )
    model = next(c for c in found if c.name == "model")  # not listed: the chat probe decides
    assert "not listed" in model.detail and "sim-1" in model.detail
    chat = next(c for c in found if c.name == "chat")
    assert chat.ok is False and "404" in chat.detail and not ready(found)


def test_a_line_break_in_what_a_server_says_cannot_forge_a_check() -> None:
    """A model id (or an error) with a line break: printed as it came, it showed a line of
    the server's own making, "ok  chat ...", among doctor's (the tools review's suspicion)."""
    forged = Check("model", False, "m\nok    chat                   fine", essential=True)
    shown = render([forged, Check("reachable", True, "http://x/v1")])
    assert shown.splitlines() == [
        "FAIL  model                  m\\nok    chat                   fine",
        "ok    reachable              http://x/v1",
    ]
