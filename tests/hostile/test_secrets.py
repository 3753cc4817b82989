"""Secrets a hostile review (4 December) found reaching messages, logs and the ledger: a key
pasted where its variable's name goes, a URL's user:password in hosted batch errors."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

import batchrun

HEX_KEY = "e4b1c09f7a2d4e3b8c6f1a0d9e2b7c4f5a8d3e6b1c0f9a2d7e4b3c8f6a1d0e9b"  # a valid name


def rows(n: int) -> list[dict[str, Any]]:
    return [{"id": f"r{i}", "prompt": f"Say {i}."} for i in range(1, n + 1)]


def test_a_lowercase_hex_key_pasted_as_the_variable_name_is_not_echoed(tmp_path: Path) -> None:
    with pytest.raises(batchrun.BatchrunError) as info:
        batchrun.submit(rows(1), home=tmp_path, backend="groq", api_key_env=HEX_KEY)
    assert HEX_KEY[8:24] not in str(info.value)


def test_a_lowercase_hex_key_pasted_as_the_variable_name_never_reaches_the_ledger(
    tmp_path: Path,
) -> None:
    # key optional (vllm): it was stored with the job's spec
    with pytest.raises(batchrun.UsageError):
        batchrun.submit(
            rows(3),
            job="k",
            home=tmp_path,
            backend="vllm",
            base_url="http://127.0.0.1:1/v1",
            model="m",
            outage_timeout=0.2,
            api_key_env=HEX_KEY,
        )
    db = tmp_path / "jobs" / "ledger.db"
    assert not db.exists() or HEX_KEY not in db.read_bytes().decode("latin-1")


class _NotFound(BaseHTTPRequestHandler):
    def _answer(self) -> None:
        body = json.dumps({"error": {"message": "no such route"}}).encode()
        self.send_response(404)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _NotFound)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_password_in_the_url_never_reaches_a_hosted_batch_refusal(
    tmp_path: Path, server: str
) -> None:
    url = f"http://bob:hunter2secret@{server}/v1"
    with pytest.raises(batchrun.JobAborted) as stop:
        batchrun.submit(rows(2), job="b", home=tmp_path, base_url=url, model="m", mode="batch")
    said = [str(stop.value), (tmp_path / "logs" / "b.log").read_text()]
    assert server in said[0]  # the message names the place
    assert not any("hunter2secret" in text for text in said), said[0]


def test_a_mixed_case_variable_name_unset_at_resume_is_told_to_be_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = "Groq_Key_For_Nightly_Jobs"  # a legitimate variable name, set when submitted
    monkeypatch.setenv(name, "gsk_test")
    batchrun.submit(rows(2), job="n", home=tmp_path, backend="groq", api_key_env=name, run=False)
    monkeypatch.delenv(name)  # the cron job's environment lacks it
    with pytest.raises(batchrun.UsageError) as info:
        batchrun.resume("n", home=tmp_path)
    assert "set the environment variable" in str(info.value), str(info.value)
