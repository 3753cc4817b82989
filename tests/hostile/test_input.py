"""What a user's JSONL file goes through on its way in, and what comes out (results file,
`export`, exit codes), attacked with files a real user has. Each test fails on the code as
reviewed and names the defect in its docstring."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

import batchrun
from batchrun import jobs
from batchrun.config import resolve
from batchrun.errors import BatchrunError, InputError
from batchrun.jobs import Home
from batchrun.ledger import Ledger
from batchrun.report import JobAborted


def _write(path: Path, *rows: Any) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _results(home: Path, job: str) -> list[dict[str, Any]]:
    with (home / "outputs" / f"{job}.jsonl").open("rb") as f:
        return [json.loads(line) for line in f]


def _run_against(
    home_dir: Path, path: Path, job: str, server: Callable[[httpx.Request], httpx.Response]
) -> None:
    """Load `path` as `job` and run it against a scripted OpenAI-compatible server (not
    streamed, one at a time), then write its results file."""
    home = Home.at(home_dir, None)
    ledger = Ledger(home.ledger_url)
    spec = resolve(
        {
            "base_url": "http://fake.invalid/v1",
            "model": "m",
            "stream": False,
            "concurrency": 1,
            "server_metrics": "off",
        }
    )
    try:
        jobs.create_job(ledger, job, path, spec)

        async def run() -> None:
            transport = httpx.MockTransport(server)
            await jobs.run_job(ledger, home, job, spec, transport=transport, handle_signals=False)

        anyio.run(run)
        jobs.finish(ledger, home, job, spec)
    finally:
        ledger.close()


def _chat_answer(message: dict[str, Any], finish: str = "stop") -> httpx.Response:
    return httpx.Response(
        200,
        json={
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "model": "m",
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": {"prompt_tokens": 20, "completion_tokens": 10, "total_tokens": 30},
        },
    )


# --- meta comes back as given ------------------------------------------------------------------


def test_meta_big_integer_comes_back_as_given(tmp_path: Path) -> None:
    """README "Input": fields other than request fields "are kept as `meta` and returned in
    the output". A tracking number or an order id of more than 64 bits (a 30-digit integer)
    in a meta field comes back as another number (1.2345678901234568e+29): orjson reads it
    as a float and the results file writes that float. The user joins their rows back on a
    value that is no longer theirs, silently. Ids of that size are refused with a clear
    reason ("write it as a string"); meta is neither refused nor kept."""
    big = 123456789012345678901234567890
    path = tmp_path / "orders.jsonl"
    path.write_text(f'{{"id": "a", "prompt": "describe order a", "order": {big}}}\n')
    with pytest.raises(InputError) as refused:  # the fix: refused by number, as a big id is
        batchrun.submit(path, home=tmp_path, backend="sim")
    assert "line 1" in str(refused.value) and "write it as a string" in str(refused.value)
    assert str(big)[:10] not in str(refused.value)  # the value is not said: it may be private
    # what fits in 64 bits, and a long run of digits in a string, come back as given
    fits = tmp_path / "fits.jsonl"
    fits.write_text(
        '{"id": "b", "prompt": "describe order b", "order": 18446744073709551615, '
        '"tracking": "1234567890123456789012345", "low": -9223372036854775808}\n'
    )
    batchrun.submit(fits, home=tmp_path, backend="sim")
    [row] = _results(tmp_path, "fits")
    assert row["meta"] == {
        "order": 18446744073709551615,
        "tracking": "1234567890123456789012345",
        "low": -9223372036854775808,
    }


# --- bad lines are refused by line number, never with a traceback -------------------------------


def _nested_items_schema(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize("depth", [200, 300])
def test_a_deeply_nested_line_schema_is_a_bad_line_not_a_crash(tmp_path: Path, depth: int) -> None:
    """README "Input": "lone surrogates and nesting too deep to re-encode are refused by line
    number"; bad lines refuse the submit "listing every bad line with its number and reason
    (exit 2)". A line whose own `schema` nests 200 levels (re-encodable: orjson's limit is
    255) crashes the load with a RecursionError out of jsonschema's check_schema; at 300
    levels, with a `TypeError: Recursion limit reached` from the orjson.dumps that keys the
    schema cache. Both are raised outside the reader's handling, so the CLI prints a
    traceback and exits 1 (the code for "some items failed"), with `--skip-invalid` too."""
    path = _write(
        tmp_path / "deep.jsonl",
        {"id": "ok", "prompt": "fine"},
        {"id": "deep", "prompt": "list it", "schema": _nested_items_schema(depth)},
    )
    try:
        report = batchrun.submit(path, home=tmp_path, run=False)
    except InputError as refused:
        assert "line 2" in str(refused)  # refused by its number: the README's promise
        return
    assert depth < 255, "past orjson's depth the line cannot be re-encoded: a bad line"
    assert report.loaded == 2  # a schema that deep but re-encodable may also be loaded


# --- the line limit is the same for LF and CRLF files ------------------------------------------


def test_max_line_bytes_counts_a_crlf_line_like_an_lf_line(tmp_path: Path) -> None:
    """README "Input": CRLF line endings are accepted, and a line "longer than
    `--max-line-bytes`" is bad. The same line of exactly N bytes is accepted under
    `--max-line-bytes N` when the file ends its lines with LF, and refused ("line is longer
    than the limit of N bytes") when the file was saved on Windows (CRLF): the reader reads
    limit+1 bytes and the CR takes the byte the LF would have had. The line ending is not
    the line's content in one case and is in the other."""
    line = b'{"id": "a", "prompt": "' + b"x" * 60 + b'"}'
    lf, crlf = tmp_path / "lf.jsonl", tmp_path / "crlf.jsonl"
    lf.write_bytes(line + b"\n")
    crlf.write_bytes(line + b"\r\n")
    got = batchrun.submit(lf, home=tmp_path, run=False, max_line_bytes=len(line))
    assert got.loaded == 1  # LF: accepted at exactly the limit
    report = batchrun.submit(crlf, home=tmp_path, run=False, max_line_bytes=len(line))
    assert report.loaded == 1


# --- a line's own model ------------------------------------------------------------------------


def test_a_lines_own_unknown_model_fails_that_line_not_the_job_for_ever(tmp_path: Path) -> None:
    """README "Input": request fields on a line, `model` among them, override the job's
    defaults. One line of a nightly file names a model the (single) server does not serve:
    the server answers 404 to that line only, having answered the others. The job is
    aborted (exit 3, `JobAborted`) with the lines after it left pending, and every
    `resume` claims that line again and aborts again: the stored request cannot be fixed
    (the edited file is refused as changed input, or with --allow-changed-input its stored
    request is sent again), so the job can never finish and the other lines are never sent.
    With several endpoints the README says "a 404 to a line's own model ... fails that line
    and not the job"; with one endpoint the same line stops everything, for ever."""
    path = _write(
        tmp_path / "night.jsonl",
        {"id": "a", "prompt": "one"},
        {"id": "b", "prompt": "two", "model": "no-such-model"},
        {"id": "c", "prompt": "three"},
    )
    options: dict[str, Any] = {
        "backend": "sim",
        "concurrency": 1,
        "sim_options": {"strict_models": True},
    }
    report = None
    for _ in range(3):  # the first run and two resumes
        try:
            report = batchrun.submit(path, home=tmp_path, **options)
            break
        except JobAborted as aborted:
            report = aborted.report
    assert report is not None
    assert report.complete, report.counts
    assert report.counts["done"] == 2 and report.counts["failed"] == 1, report.counts


# --- ids of odd sizes ---------------------------------------------------------------------------


# a presigned URL: its signature does not compress (PostgreSQL compresses what it can)
_SIGNATURE = "".join(hashlib.sha256(str(n).encode()).hexdigest() for n in range(50))
_ODD_IDS = {
    "presigned-url": f"https://bucket.example/doc.pdf?X-Signature={_SIGNATURE}",
    "nul": "sku-1\u0000b",
}


@pytest.mark.parametrize("kind", sorted(_ODD_IDS))
def test_an_odd_id_loads_on_postgresql_as_on_sqlite(
    ledger_url: str, tmp_path: Path, kind: str
) -> None:
    """README "Input": `id` "is a string or an integer, unique in the file" (no length or
    character limit); bad lines are listed by number, and `--skip-invalid` records them as
    rejected. An id of 3,250 characters (a presigned URL) or one holding a NUL (`\u0000`)
    loads on SQLite, but on PostgreSQL the whole load is rolled back: "ledger error while
    loading the input: index row size 3264 exceeds btree version 4 maximum 2704 ... (is the
    disk full, or the file over a size limit?)" (the unique index on (job, item_id)), or
    "PostgreSQL text fields cannot contain NUL (0x00) bytes". No line is named, and
    `--skip-invalid` cannot skip it: one line refuses the file on one ledger and not on the
    other, and the user is sent to look at their disk."""
    path = _write(
        tmp_path / "ids.jsonl",
        {"id": _ODD_IDS[kind], "prompt": "summarise this page"},
        {"id": "short", "prompt": "summarise that page"},
    )
    report = batchrun.submit(path, home=tmp_path, ledger=ledger_url, run=False, skip_invalid=True)
    assert report.loaded is not None and report.loaded >= 1  # at least the other line


# --- answers that are not text ------------------------------------------------------------------


_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def _tool_call_server(request: httpx.Request) -> httpx.Response:
    if request.method == "GET":
        return httpx.Response(200, json={"object": "list", "data": [{"id": "m"}]})
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    return _chat_answer({"role": "assistant", "content": None, "tool_calls": [call]}, "tool_calls")


def test_a_tool_call_answer_is_not_recorded_as_an_empty_done(tmp_path: Path) -> None:
    """`tools` and `tool_choice` are request fields a line may carry, and messages with
    `tool_calls` are accepted as input. The answer to such a line may be a tool call
    (`content: null`, `tool_calls: [...]`, finish_reason "tool_calls"): batchrun recorded it
    as `done` with `"output": ""` and dropped the call, in the results file and in `export
    --format openai` alike (exit 0, and reuse handed the same empty answer to later jobs).
    batchrun keeps text answers: such an answer is `failed`, and says why. (The review's
    test asked for the call kept; the fix chosen, in the README, is to say it is not.)"""
    path = _write(
        tmp_path / "tools.jsonl",
        {"id": "w", "prompt": "weather in Paris?", "tools": _TOOLS, "tool_choice": "auto"},
    )
    _run_against(tmp_path, path, "tools", _tool_call_server)
    [row] = _results(tmp_path, "tools")
    assert row["status"] == "failed", row
    assert "tool call" in row["error"], row


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "x"}}])
def test_a_line_that_allows_only_a_tool_call_is_refused_before_it_is_paid_for(
    tmp_path: Path, choice: Any
) -> None:
    """A line whose `tool_choice` leaves no text answer ("required", or a function named)
    would be paid for and fail: it is a bad line at submit, by its number."""
    path = _write(
        tmp_path / "calls.jsonl",
        {"id": "ok", "prompt": "hello"},
        {"id": "w", "prompt": "weather?", "tools": _TOOLS, "tool_choice": choice},
    )
    with pytest.raises(InputError) as refused:
        batchrun.submit(path, home=tmp_path, run=False)
    assert "line 2" in str(refused.value) and "tool call" in str(refused.value)


# --- input file names ---------------------------------------------------------------------------


def test_an_input_file_whose_name_is_not_utf8_is_not_a_traceback(tmp_path: Path) -> None:
    """A file copied from an old Latin-1 system or unpacked from a Windows zip has a name
    that is not UTF-8 (`caf\\xe9.jsonl`): Python hands it over with a surrogate escape.
    `batchrun submit` reads the file fine, then crashes storing its path in the ledger:
    `UnicodeEncodeError: 'utf-8' codec can't encode character '\\udce9' ... surrogates not
    allowed`, a traceback and exit 1 (the code for "some items failed"), with `--job` given
    or not. README: exit 2 is for usage and input errors, said in one line; the file itself
    is a good one."""
    name = os.fsdecode(b"caf\xe9.jsonl")
    path = _write(tmp_path / name, {"id": "a", "prompt": "describe a cafe"})
    try:
        report = batchrun.submit(path, job="cafe", home=tmp_path, backend="sim")
    except BatchrunError:
        return  # refused with a message (exit 2 on the command line): acceptable
    assert report.ok, report.counts


# --- per-line request fields --------------------------------------------------------------------


def test_a_lines_request_fields_reach_the_server_in_every_shape(tmp_path: Path) -> None:
    """README "Input": "Request fields on a line (`max_tokens`, `temperature`, `top_p`,
    `stop`, `seed`, `response_format`, `model`, ...) override the job's defaults". Which
    fields count is a fixed list (inputs.REQUEST_FIELDS); any other goes to `meta` and is
    never sent. OpenAI's `reasoning_effort` and vLLM's `chat_template_kwargs` (`{"enable_
    thinking": false}`, a Qwen3 night without thinking) on a prompt line are silently not
    sent: the answers come back made with the server's defaults (paid for, `done`), the
    fields echoed in `meta` as if they had been used. The same request in the OpenAI Batch
    shape, whose `body` goes out whole, does send them: the shape of a line, not the user,
    decides what is asked."""
    seen: list[dict[str, Any]] = []

    def server(request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "m"}]})
        seen.append(json.loads(request.content))
        return _chat_answer({"role": "assistant", "content": "ok"})

    asked = {"reasoning_effort": "low", "chat_template_kwargs": {"enable_thinking": False}}
    messages = [{"role": "user", "content": "think briefly"}]
    path = _write(
        tmp_path / "fields.jsonl",
        {"id": "plain", "prompt": "think briefly", **asked},
        {
            "custom_id": "batch",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"messages": messages, "max_tokens": 5, **asked},
        },
    )
    _run_against(tmp_path, path, "fields", server)
    assert len(seen) == 2
    for body in seen:
        for key, value in asked.items():
            assert body.get(key) == value, (key, body)
