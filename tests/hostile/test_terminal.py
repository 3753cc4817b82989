"""A server's words never reach the user's terminal raw (issue 13 item 6): error text holding an
OSC title sequence, colour codes, a carriage return or a C1 control is printed escaped by the
run's summary, `status` and `doctor`, and `status --json` stays JSON with the same values."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from batchrun.cli_errors import printable
from tests.hostile.server import Behaviour, serving
from tests.integration.helpers import CLI

EVIL = "\x1b]0;pwned\x07\x1b[32mall good\x1b[0m\rFAIL hidden\x9b2J\nbatchrun: ready \u202eevil"
RAW = ("\x1b", "\x07", "\r", "\x9b", "\u202e", "\nbatchrun: ready")


@pytest.fixture
def cli(tmp_path: Path) -> CLI:
    (tmp_path / "home").mkdir()
    return CLI(tmp_path / "home")


def assert_clean(text: str) -> None:
    assert not any(c in text for c in RAW), repr(text)


def strings(data: Any) -> Iterator[str]:
    if isinstance(data, str):
        yield data
    elif isinstance(data, dict | list):
        for value in data.values() if isinstance(data, dict) else data:
            yield from strings(value)


def test_printable_escapes_controls_but_keeps_lines_and_tabs() -> None:
    assert printable("a\tb\nc\x1b[0m\r\x7f\x9b") == "a\tb\nc\\u001b[0m\\u000d\\u007f\\u009b"
    assert printable("\u202e\u2028\u2066") == "\\u202e\\u2028\\u2066"  # bidi, line separator
    assert json.loads(printable(orjson.dumps({"e": EVIL}).decode())) == {"e": EVIL}


def test_summary_status_and_doctor_print_a_servers_escapes_escaped(
    cli: CLI, tmp_path: Path
) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "a", "prompt": "hi"}\n')
    refusal = orjson.dumps({"error": {"message": EVIL}})
    with serving(Behaviour(body=refusal, status=401)) as url:  # a 401 aborts: in the summary
        aborted = cli.run("submit", str(prompts), "--job", "k", "--base-url", url, "--model", "m")
    with serving(Behaviour(body=refusal, status=400)) as url:  # a 400 fails the item: in status
        run = cli.run("submit", str(prompts), "--base-url", url, "--model", "m")
        doctor = cli.run("doctor", "--base-url", url, "--model", "m")
    assert aborted.returncode == 3 and "ABORTED" in aborted.stderr
    assert run.returncode == 1 and "1 failed" in run.stderr
    assert f"checking at {url} ..." in doctor.stderr  # not the internal preset name "custom"
    status = cli.run("status", "p")
    assert "FAIL hidden" in status.stdout
    assert_clean(run.stderr)
    for printed in (aborted.stderr, status.stdout, doctor.stdout):
        assert_clean(printed)
        assert "\\u001b]0;pwned\\u0007" in printed and "\\u009b2J" in printed
        assert "\\u202eevil" in printed
    detail = cli.run("status", "p", "--json").stdout
    assert not any(c in detail for c in RAW)
    # the same value as stored (a server's line breaks are spaces: one line per message)
    stored = " ".join(EVIL.split())
    assert any(stored in text for text in strings(json.loads(detail)))
