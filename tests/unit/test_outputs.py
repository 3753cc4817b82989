"""outputs.write_results: native and OpenAI Batch shapes, order, atomic replacement, errors."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from batchrun.errors import OutputError
from batchrun.ledger.records import StoredItem
from batchrun.outputs import write_results

DIGEST = "ab" * 32


def make_row(**overrides: Any) -> StoredItem:
    row: dict[str, Any] = {
        "item_id": "a1",
        "line": 1,
        "status": "done",
        "output": '{"name": "mug"}',
        "parsed": '{"name": "mug"}',
        "finish_reason": "stop",
        "prompt_tokens": 31,
        "completion_tokens": 12,
        "latency_ms": 812.4,
        "ttft_ms": 95.6,
        "attempts": 1,
        "error": None,
        "meta": '{"source": "crm", "n": 3}',
        "digest": DIGEST,
        "endpoint": "chat",
        "updated_at": 1796000000.25,
    }
    row.update(overrides)
    for column in ("parsed", "meta"):  # given as stored (JSON text), handed out parsed
        if isinstance(row[column], str):
            row[column] = orjson.loads(row[column])
    return StoredItem(
        **{"repairs": 0, "repair_prompt_tokens": 0, "repair_completion_tokens": 0, **row}
    )


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    data = path.read_bytes()
    assert data.endswith(b"\n")
    return [orjson.loads(line) for line in data.splitlines()]


def folder_names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


# --- native -------------------------------------------------------------------------------------


def test_native_done_record_field_by_field(tmp_path: Path) -> None:
    path = tmp_path / "job.jsonl"
    assert write_results(path, [make_row()]) == 1
    (record,) = read_jsonl(path)
    assert record == {
        "id": "a1",
        "line": 1,
        "status": "done",
        "output": '{"name": "mug"}',
        "parsed": {"name": "mug"},
        "finish_reason": "stop",
        "usage": {"prompt_tokens": 31, "completion_tokens": 12},
        "latency_ms": 812,
        "ttft_ms": 96,
        "attempts": 1,
        "repairs": None,
        "error": None,
        "meta": {"source": "crm", "n": 3},
    }
    assert isinstance(record["latency_ms"], int)
    assert isinstance(record["ttft_ms"], int)


def unfinished_row(**overrides: Any) -> dict[str, Any]:
    """A row with no answer (failed or rejected): every result field empty."""
    empty = dict(
        output=None,
        parsed=None,
        finish_reason=None,
        prompt_tokens=None,
        completion_tokens=None,
        latency_ms=None,
        ttft_ms=None,
        meta=None,
    )
    return make_row(**{**empty, **overrides})


def test_native_failed_record(tmp_path: Path) -> None:
    row = unfinished_row(
        item_id="b2", line=2, status="failed", attempts=5, error="503 Service Unavailable"
    )
    path = tmp_path / "job.jsonl"
    write_results(path, [row])
    (record,) = read_jsonl(path)
    assert record == {
        "id": "b2",
        "line": 2,
        "status": "failed",
        "output": None,
        "parsed": None,
        "finish_reason": None,
        "usage": None,
        "latency_ms": None,
        "ttft_ms": None,
        "attempts": 5,
        "repairs": None,
        "error": "503 Service Unavailable",
        "meta": None,
    }


def test_native_record_shows_what_repairs_cost(tmp_path: Path) -> None:
    path = tmp_path / "job.jsonl"
    row = make_row(repairs=2, repair_prompt_tokens=120, repair_completion_tokens=30)
    write_results(path, [row])
    (record,) = read_jsonl(path)
    assert record["repairs"] == {"requests": 2, "prompt_tokens": 120, "completion_tokens": 30}
    assert record["usage"] == {"prompt_tokens": 31, "completion_tokens": 12}


def test_native_partial_usage_keeps_both_keys(tmp_path: Path) -> None:
    path = tmp_path / "job.jsonl"
    write_results(path, [make_row(prompt_tokens=None, completion_tokens=4)])
    (record,) = read_jsonl(path)
    assert record["usage"] == {"prompt_tokens": None, "completion_tokens": 4}


def test_native_rejected_and_invalid_rows(tmp_path: Path) -> None:
    rows = [
        unfinished_row(
            item_id="3",
            line=3,
            status="rejected",
            attempts=0,
            error="'prompt' is empty",
            digest=None,
        ),
        make_row(
            item_id="4",
            line=4,
            status="invalid",
            output='{"name": ',
            parsed=None,
            finish_reason="length",
            error="output is not valid JSON",
        ),
    ]
    path = tmp_path / "job.jsonl"
    write_results(path, rows)
    rejected, invalid = read_jsonl(path)
    assert rejected["status"] == "rejected"
    assert rejected["error"] == "'prompt' is empty"
    assert rejected["attempts"] == 0
    assert invalid["status"] == "invalid"
    assert invalid["parsed"] is None
    assert invalid["output"] == '{"name": '
    assert invalid["finish_reason"] == "length"


def test_native_keeps_unicode_output(tmp_path: Path) -> None:
    path = tmp_path / "job.jsonl"
    write_results(path, [make_row(output="Café ☕ — ok\nline two", parsed=None)])
    (record,) = read_jsonl(path)
    assert record["output"] == "Café ☕ — ok\nline two"
    assert len(path.read_bytes().splitlines()) == 1  # the newline is escaped, one line per row


# --- openai -------------------------------------------------------------------------------------


def test_openai_done_chat(tmp_path: Path) -> None:
    path = tmp_path / "job.jsonl"
    assert write_results(path, [make_row()], fmt="openai", model="gemma-31b") == 1
    (record,) = read_jsonl(path)
    assert set(record) == {"id", "custom_id", "response", "error"}
    assert record["custom_id"] == "a1"
    assert record["error"] is None
    assert isinstance(record["id"], str)
    assert record["id"]
    response = record["response"]
    assert set(response) >= {"status_code", "request_id", "body"}
    assert response["status_code"] == 200
    assert isinstance(response["request_id"], str)
    assert response["request_id"]
    body = response["body"]
    assert body["object"] == "chat.completion"
    assert body["created"] == 1796000000
    assert body["model"] == "gemma-31b"
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": '{"name": "mug"}'},
            "finish_reason": "stop",
        }
    ]
    assert body["usage"] == {"prompt_tokens": 31, "completion_tokens": 12, "total_tokens": 43}


def test_openai_done_completions(tmp_path: Path) -> None:
    row = make_row(endpoint="completions", output=" there was a cat", finish_reason="length")
    path = tmp_path / "job.jsonl"
    write_results(path, [row], fmt="openai", model="stories")
    (record,) = read_jsonl(path)
    assert record["error"] is None
    body = record["response"]["body"]
    assert record["response"]["status_code"] == 200
    assert body["object"] == "text_completion"
    assert body["model"] == "stories"
    assert body["choices"] == [{"index": 0, "text": " there was a cat", "finish_reason": "length"}]
    assert body["usage"]["total_tokens"] == 43


def test_openai_failed_row_has_no_response_and_an_error(tmp_path: Path) -> None:
    row = unfinished_row(status="failed", error="400 context length exceeded")
    path = tmp_path / "job.jsonl"
    write_results(path, [row], fmt="openai", model="m")
    (record,) = read_jsonl(path)
    assert record["custom_id"] == "a1"
    assert record["response"] is None
    assert record["error"] is not None
    assert record["error"]["message"] == "400 context length exceeded"
    assert record["error"]["code"] == "failed"


def test_openai_rejected_row_without_digest(tmp_path: Path) -> None:
    row = unfinished_row(item_id="7", line=7, status="rejected", error=None, digest=None)
    path = tmp_path / "job.jsonl"
    write_results(path, [row], fmt="openai")
    (record,) = read_jsonl(path)
    assert record["custom_id"] is None  # not "7": that may be a real item's id
    assert record["response"] is None
    assert record["error"]["code"] == "rejected"
    assert record["error"]["message"]  # never an empty message, even without a stored error
    assert isinstance(record["id"], str)
    assert record["id"]


def test_openai_ids_are_distinct_per_row(tmp_path: Path) -> None:
    rows = [
        make_row(item_id="a", line=1, digest="11" * 32),
        make_row(item_id="b", line=2, digest="22" * 32),
        make_row(item_id="c", line=3, digest=None, status="rejected"),
        make_row(item_id="d", line=4, digest=None, status="rejected"),
    ]
    path = tmp_path / "job.jsonl"
    write_results(path, rows, fmt="openai")
    records = read_jsonl(path)
    assert len({r["id"] for r in records}) == 4


def test_openai_ids_are_distinct_for_identical_requests(tmp_path: Path) -> None:
    # The same prompt twice in one file (e.g. sampled twice) gives two rows with one digest;
    # in the OpenAI Batch output every line still has its own id and request_id.
    rows = [
        make_row(item_id="first", line=1, digest="33" * 32),
        make_row(item_id="second", line=2, digest="33" * 32),
    ]
    path = tmp_path / "job.jsonl"
    write_results(path, rows, fmt="openai")
    first, second = read_jsonl(path)
    assert first["id"] != second["id"]
    assert first["response"]["request_id"] != second["response"]["request_id"]


def test_openai_invalid_row_keeps_response_and_sets_error(tmp_path: Path) -> None:
    row = make_row(status="invalid", parsed=None, error="does not match the schema")
    path = tmp_path / "job.jsonl"
    write_results(path, [row], fmt="openai", model="m")
    (record,) = read_jsonl(path)
    assert record["response"]["status_code"] == 200
    assert record["response"]["body"]["choices"][0]["message"]["content"] == '{"name": "mug"}'
    assert record["error"] == {"code": "invalid", "message": "does not match the schema"}


# --- order, counts, atomicity -------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["native", "openai"])
def test_lines_are_written_in_the_order_given(tmp_path: Path, fmt: str) -> None:
    ids = ["z", "a", "m", "10", "2"]
    rows = [make_row(item_id=i, line=n) for n, i in enumerate(ids, start=1)]
    path = tmp_path / "job.jsonl"
    assert write_results(path, iter(rows), fmt=fmt) == len(ids)
    key = "id" if fmt == "native" else "custom_id"
    assert [r[key] for r in read_jsonl(path)] == ids


def test_no_rows_writes_an_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "job.jsonl"
    assert write_results(path, []) == 0
    assert path.read_bytes() == b""


def test_no_temp_file_is_left_behind(tmp_path: Path) -> None:
    path = tmp_path / "job.jsonl"
    write_results(path, [make_row(), make_row(item_id="b", line=2)])
    assert folder_names(tmp_path) == ["job.jsonl"]


def test_creates_missing_output_folder(tmp_path: Path) -> None:
    path = tmp_path / "outputs" / "nested" / "job.jsonl"
    write_results(path, [make_row()])
    assert len(read_jsonl(path)) == 1
    assert folder_names(path.parent) == ["job.jsonl"]


def test_existing_results_are_replaced(tmp_path: Path) -> None:
    path = tmp_path / "job.jsonl"
    path.write_bytes(b"old results\n" * 100)
    write_results(path, [make_row()])
    (record,) = read_jsonl(path)
    assert record["id"] == "a1"
    assert folder_names(tmp_path) == ["job.jsonl"]


def test_failure_midway_leaves_the_old_file_untouched(tmp_path: Path) -> None:
    path = tmp_path / "job.jsonl"
    old = b'{"id": "old"}\n'
    path.write_bytes(old)

    class LedgerBroke(RuntimeError):
        pass

    def rows() -> Iterator[dict[str, Any]]:
        yield make_row(item_id="new1")
        yield make_row(item_id="new2", line=2)
        raise LedgerBroke("database is locked")

    with pytest.raises(LedgerBroke):
        write_results(path, rows())
    assert path.read_bytes() == old
    assert folder_names(tmp_path) == ["job.jsonl"]


def test_failure_midway_with_no_previous_file_leaves_nothing(tmp_path: Path) -> None:
    path = tmp_path / "job.jsonl"

    def rows() -> Iterator[dict[str, Any]]:
        yield make_row()
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_results(path, rows())
    assert folder_names(tmp_path) == []


def test_bad_row_midway_leaves_the_old_file_untouched(tmp_path: Path) -> None:
    path = tmp_path / "job.jsonl"
    path.write_bytes(b"previous\n")
    broken = make_row(meta=object())  # a value no JSON can hold
    with pytest.raises(TypeError):
        write_results(path, [make_row(), broken])
    assert path.read_bytes() == b"previous\n"
    assert folder_names(tmp_path) == ["job.jsonl"]


def test_parent_is_a_regular_file(tmp_path: Path) -> None:
    blocker = tmp_path / "outputs"
    blocker.write_bytes(b"not a folder")
    with pytest.raises(OutputError, match=r"job\.jsonl"):
        write_results(blocker / "job.jsonl", [make_row()])
    assert blocker.read_bytes() == b"not a folder"
    assert folder_names(tmp_path) == ["outputs"]


def test_grandparent_is_a_regular_file(tmp_path: Path) -> None:
    blocker = tmp_path / "outputs"
    blocker.write_bytes(b"not a folder")
    with pytest.raises(OutputError):
        write_results(blocker / "sub" / "job.jsonl", [make_row()])
    assert blocker.read_bytes() == b"not a folder"
    assert folder_names(tmp_path) == ["outputs"]


def test_target_is_a_directory(tmp_path: Path) -> None:
    target = tmp_path / "job.jsonl"
    target.mkdir()
    (target / "keep").write_bytes(b"x")
    with pytest.raises(OutputError):
        write_results(target, [make_row()])
    assert folder_names(tmp_path) == ["job.jsonl"]
    assert folder_names(target) == ["keep"]


def test_unknown_format(tmp_path: Path) -> None:
    path = tmp_path / "job.jsonl"
    with pytest.raises(OutputError, match="csv"):
        write_results(path, [make_row()], fmt="csv")
    assert folder_names(tmp_path) == []


def test_unknown_format_does_not_consume_rows(tmp_path: Path) -> None:
    consumed: list[int] = []

    def rows() -> Iterator[dict[str, Any]]:
        consumed.append(1)
        yield make_row()

    with pytest.raises(OutputError):
        write_results(tmp_path / "job.jsonl", rows(), fmt="OpenAI")
    assert consumed == []


def test_two_writers_of_one_results_file_in_one_process_each_write_it_whole(
    tmp_path: Path,
) -> None:
    """Two threads of one process (two API workers finishing one job together, or two
    exports) write the same results file at once. Their temp files were one name
    (`.{name}.tmp-{pid}`): each truncated the other's, and the second rename found nothing
    (an OutputError) or moved a mixed file into place."""
    import threading

    path = tmp_path / "out.jsonl"
    both = threading.Barrier(2)
    errors: list[BaseException] = []

    def rows() -> Iterator[StoredItem]:
        for line in range(1, 201):
            if line == 100:
                both.wait(timeout=10)  # the two writers are half way, at once
            yield make_row(item_id=f"a{line}", line=line)

    def write() -> None:
        try:
            write_results(path, rows())
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=write) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert [r["line"] for r in read_jsonl(path)] == list(range(1, 201))
    assert folder_names(tmp_path) == ["out.jsonl"]  # no temp file left behind
