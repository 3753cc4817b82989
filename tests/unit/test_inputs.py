"""InputReader: line shapes, ids, request bodies, digests, bad lines and file statistics."""

from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchrun.errors import UsageError
from batchrun.inputs import BadLine, InputItem, InputReader, canonical_digest
from tests.fakes import input_reader


def write_lines(path: Path, lines: list[Any], *, newline: str = "\n") -> Path:
    """Write each entry as one line: str as is, anything else JSON-encoded."""
    text = newline.join(line if isinstance(line, str) else json.dumps(line) for line in lines)
    path.write_text(text + newline, encoding="utf-8", newline="")
    return path


def read_all(path: Path, **kwargs: Any) -> tuple[InputReader, list[InputItem | BadLine]]:
    reader = input_reader(path, **kwargs)
    return reader, list(reader)


def only_item(entries: list[InputItem | BadLine]) -> InputItem:
    assert len(entries) == 1
    (entry,) = entries
    assert isinstance(entry, InputItem), entry
    return entry


def only_bad(entries: list[InputItem | BadLine]) -> BadLine:
    assert len(entries) == 1
    (entry,) = entries
    assert isinstance(entry, BadLine), entry
    return entry


def expected_digest(defaults: dict[str, Any], body: dict[str, Any]) -> str:
    """sha256 of the canonical body, computed without batchrun's help."""
    merged = {**defaults, **body}
    text = json.dumps(merged, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def one_line(tmp_path: Path, line: Any, **kwargs: Any) -> InputItem | BadLine:
    path = write_lines(tmp_path / "in.jsonl", [line])
    _, entries = read_all(path, **kwargs)
    assert len(entries) == 1
    return entries[0]


# --- shapes -------------------------------------------------------------------------------------


def test_prompt_shape_on_chat_becomes_one_user_message(tmp_path: Path) -> None:
    item = one_line(tmp_path, {"id": "a1", "prompt": "Say hi"})
    assert isinstance(item, InputItem)
    assert item.line == 1
    assert item.item_id == "a1"
    assert item.endpoint == "chat"
    assert orjson.loads(item.body) == {"messages": [{"role": "user", "content": "Say hi"}]}
    assert item.meta is None


def test_prompt_shape_on_completions_keeps_prompt(tmp_path: Path) -> None:
    item = one_line(tmp_path, {"id": "a1", "prompt": "Once upon"}, endpoint="completions")
    assert isinstance(item, InputItem)
    assert item.endpoint == "completions"
    assert orjson.loads(item.body) == {"prompt": "Once upon"}


def test_messages_shape(tmp_path: Path) -> None:
    messages = [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Name a colour."},
    ]
    item = one_line(tmp_path, {"id": "m1", "messages": messages})
    assert isinstance(item, InputItem)
    assert item.item_id == "m1"
    assert item.endpoint == "chat"
    assert orjson.loads(item.body) == {"messages": messages}


def test_batch_shape_chat(tmp_path: Path) -> None:
    body = {
        "model": "gpt-x",
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 7,
    }
    line = {"custom_id": "req-1", "method": "POST", "url": "/v1/chat/completions", "body": body}
    item = one_line(tmp_path, line, endpoint="completions")
    assert isinstance(item, InputItem)
    assert item.item_id == "req-1"
    # the batch url decides the endpoint, not the job's default
    assert item.endpoint == "chat"
    assert orjson.loads(item.body) == body
    assert item.meta is None
    assert item.digest == expected_digest({}, body)


def test_batch_shape_completions(tmp_path: Path) -> None:
    body = {"model": "gpt-x", "prompt": "Once upon a time", "max_tokens": 5}
    line = {"custom_id": "req-2", "method": "POST", "url": "/v1/completions", "body": body}
    item = one_line(tmp_path, line)
    assert isinstance(item, InputItem)
    assert item.item_id == "req-2"
    assert item.endpoint == "completions"
    assert orjson.loads(item.body) == body


def test_batch_shape_drops_stream_flags_and_keeps_extra_fields_as_meta(tmp_path: Path) -> None:
    body = {
        "messages": [{"role": "user", "content": "x"}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    line = {
        "custom_id": "b",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": body,
        "tag": "t1",
    }
    item = one_line(tmp_path, line)
    assert isinstance(item, InputItem)
    assert orjson.loads(item.body) == {"messages": [{"role": "user", "content": "x"}]}
    assert item.meta is not None
    assert orjson.loads(item.meta) == {"tag": "t1"}


def test_mixed_shapes_in_one_file(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "in.jsonl",
        [
            {"prompt": "p"},
            {"messages": [{"role": "user", "content": "m"}]},
            {
                "custom_id": "c",
                "url": "/v1/chat/completions",
                "body": {"messages": [{"role": "user", "content": "b"}]},
            },
        ],
    )
    _, entries = read_all(path)
    assert [type(e) for e in entries] == [InputItem, InputItem, InputItem]
    assert [e.line for e in entries] == [1, 2, 3]
    assert [e.item_id for e in entries if isinstance(e, InputItem)] == ["1", "2", "c"]


# --- ids ----------------------------------------------------------------------------------------


def test_default_id_is_the_line_number(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "in.jsonl",
        [{"prompt": "a"}, "", {"prompt": "b"}, {"id": "x", "prompt": "c"}, {"prompt": "d"}],
    )
    _, entries = read_all(path)
    items = [e for e in entries if isinstance(e, InputItem)]
    assert len(items) == len(entries) == 4
    assert [(i.line, i.item_id) for i in items] == [(1, "1"), (3, "3"), (4, "x"), (5, "5")]


def test_batch_line_without_custom_id_gets_line_number(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "in.jsonl",
        [
            {"prompt": "a"},
            {"url": "/v1/completions", "body": {"prompt": "b"}},
        ],
    )
    _, entries = read_all(path)
    assert isinstance(entries[1], InputItem)
    assert entries[1].item_id == "2"


def test_int_ids_become_strings(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "in.jsonl",
        [
            {"id": 42, "prompt": "a"},
            {"id": 0, "prompt": "b"},
            {"id": -7, "prompt": "c"},
            {"custom_id": 9, "url": "/v1/completions", "body": {"prompt": "d"}},
        ],
    )
    _, entries = read_all(path)
    ids = [e.item_id for e in entries if isinstance(e, InputItem)]
    assert ids == ["42", "0", "-7", "9"]
    assert all(isinstance(i, str) for i in ids)


# --- request fields, meta, digest ---------------------------------------------------------------


def test_per_line_request_fields_land_in_the_body(tmp_path: Path) -> None:
    fmt = {"type": "json_object"}
    item = one_line(
        tmp_path,
        {"prompt": "p", "max_tokens": 12, "temperature": 0.2, "response_format": fmt},
    )
    assert isinstance(item, InputItem)
    body = orjson.loads(item.body)
    assert body["max_tokens"] == 12
    assert body["temperature"] == 0.2
    assert body["response_format"] == fmt
    assert body["messages"] == [{"role": "user", "content": "p"}]
    assert item.meta is None


@pytest.mark.parametrize(
    "override",
    [{"max_tokens": 12}, {"temperature": 0.2}, {"response_format": {"type": "json_object"}}],
)
def test_per_line_override_changes_the_digest(tmp_path: Path, override: dict[str, Any]) -> None:
    path = write_lines(tmp_path / "in.jsonl", [{"prompt": "p"}, {"prompt": "p", **override}])
    _, entries = read_all(path)
    plain, overridden = entries
    assert isinstance(plain, InputItem)
    assert isinstance(overridden, InputItem)
    assert plain.digest != overridden.digest
    messages = [{"role": "user", "content": "p"}]
    assert plain.digest == expected_digest({}, {"messages": messages})
    assert overridden.digest == expected_digest({}, {"messages": messages, **override})


def test_unknown_top_level_fields_go_to_meta(tmp_path: Path) -> None:
    line = {"id": "a", "prompt": "p", "source": "crm", "row": {"n": 3, "tags": ["x"]}, "z": None}
    item = one_line(tmp_path, line)
    assert isinstance(item, InputItem)
    assert item.meta is not None
    assert orjson.loads(item.meta) == {"source": "crm", "row": {"n": 3, "tags": ["x"]}, "z": None}
    body = orjson.loads(item.body)
    assert set(body) == {"messages"}


def test_meta_does_not_change_the_digest(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "in.jsonl", [{"prompt": "p"}, {"prompt": "p", "tag": "x"}])
    _, entries = read_all(path)
    a, b = entries
    assert isinstance(a, InputItem)
    assert isinstance(b, InputItem)
    assert a.digest == b.digest


def test_digest_is_sha256_of_the_lines_canonical_body(tmp_path: Path) -> None:
    line = {"id": "é1", "temperature": 0.2, "prompt": "Décris ce produit ☕", "seed": 3}
    item = one_line(tmp_path, line)
    assert isinstance(item, InputItem)
    merged = {  # the line's own fields: the run's defaults are in its answers' options
        "temperature": 0.2,
        "seed": 3,
        "messages": [{"role": "user", "content": "Décris ce produit ☕"}],
    }
    canonical = json.dumps(merged, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    # the stdlib and orjson agree on this sample, so the expectation is implementation-free
    assert canonical.encode() == orjson.dumps(merged, option=orjson.OPT_SORT_KEYS)
    assert item.digest == hashlib.sha256(canonical.encode("utf-8")).hexdigest()
    # the stored body holds only the line's own fields; defaults are added at send time
    assert orjson.loads(item.body) == {
        "temperature": 0.2,
        "seed": 3,
        "messages": [{"role": "user", "content": "Décris ce produit ☕"}],
    }


def test_digest_does_not_depend_on_key_order(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_bytes(
        b'{"prompt":"p","max_tokens":5,"temperature":0.1}\n'
        b'{"temperature":0.1,"max_tokens":5,"prompt":"p"}\n'
    )
    _, entries = read_all(path)
    a, b = entries
    assert isinstance(a, InputItem)
    assert isinstance(b, InputItem)
    assert a.digest == b.digest


def test_digest_is_the_lines_own_request(tmp_path: Path) -> None:
    # The run's defaults are in the answer's options (reuse.answer_spec), as they are when
    # the request is sent; in the digest they were the submit's, which a resume may change.
    path = write_lines(tmp_path / "in.jsonl", [{"prompt": "p"}])
    (a,) = InputReader(path)
    assert isinstance(a, InputItem)
    assert a.digest == canonical_digest({"messages": [{"role": "user", "content": "p"}]})


# --- bad lines ----------------------------------------------------------------------------------


BAD_LINES: list[tuple[str, str, list[str]]] = [
    ("bad json", '{"prompt": "x"', ["invalid json"]),
    ("trailing garbage", '{"prompt": "x"} y', ["invalid json"]),
    ("array", '["prompt", "x"]', ["object", "array"]),
    ("string", '"just a string"', ["object", "string"]),
    ("number", "12", ["object", "number"]),
    ("null", "null", ["object", "null"]),
    ("no prompt or messages", '{"id": "a", "text": "x"}', ["prompt", "messages"]),
    (
        "both",
        '{"prompt": "x", "messages": [{"role": "user", "content": "y"}]}',
        ["prompt", "messages", "both"],
    ),
    ("prompt not a string", '{"prompt": 5}', ["prompt", "string"]),
    ("prompt list", '{"prompt": ["a"]}', ["prompt", "string"]),
    ("empty prompt", '{"prompt": ""}', ["prompt", "empty"]),
    ("blank prompt", '{"prompt": "   "}', ["prompt", "empty"]),
    ("messages not a list", '{"messages": "hi"}', ["messages", "array"]),
    ("messages empty", '{"messages": []}', ["messages", "array"]),
    ("message not an object", '{"messages": ["hi"]}', ["messages[0]", "object"]),
    ("message without role", '{"messages": [{"content": "hi"}]}', ["messages[0]", "role"]),
    ("role not a string", '{"messages": [{"role": 1, "content": "hi"}]}', ["messages[0]", "role"]),
    (
        "content a number",
        '{"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": 3}]}',
        ["messages[1]", "content"],
    ),
    ("content missing", '{"messages": [{"role": "user"}]}', ["messages[0]", "content"]),
    (
        "content object",
        '{"messages": [{"role": "user", "content": {"a": 1}}]}',
        ["messages[0]", "content"],
    ),
    ("id null", '{"id": null, "prompt": "x"}', ["'id'", "null"]),
    ("id true", '{"id": true, "prompt": "x"}', ["'id'", "boolean"]),
    ("id false", '{"id": false, "prompt": "x"}', ["'id'", "boolean"]),
    ("id float", '{"id": 1.5, "prompt": "x"}', ["'id'", "number"]),
    ("id object", '{"id": {"a": 1}, "prompt": "x"}', ["'id'", "object"]),
    ("id array", '{"id": [1], "prompt": "x"}', ["'id'", "array"]),
    ("id empty", '{"id": "", "prompt": "x"}', ["'id'", "empty"]),
    ("id blank", '{"id": "  ", "prompt": "x"}', ["'id'", "empty"]),
    (
        "custom_id null",
        '{"custom_id": null, "url": "/v1/completions", "body": {"prompt": "x"}}',
        ["'custom_id'", "null"],
    ),
    (
        "custom_id empty",
        '{"custom_id": "", "url": "/v1/completions", "body": {"prompt": "x"}}',
        ["'custom_id'", "empty"],
    ),
    (
        "batch method GET",
        '{"custom_id": "a", "method": "GET", "url": "/v1/completions", "body": {"prompt": "x"}}',
        ["method", "POST", "GET"],
    ),
    (
        "batch url embeddings",
        '{"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}}',
        ["url", "/v1/embeddings"],
    ),
    ("batch url missing", '{"custom_id": "a", "body": {"prompt": "x"}}', ["url"]),
    (
        "batch body array",
        '{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": []}',
        ["body", "object", "array"],
    ),
    (
        "batch body string",
        '{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": "x"}',
        ["body", "object", "string"],
    ),
    (
        "batch body missing",
        '{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions"}',
        ["body", "object", "null"],
    ),
    (
        "batch chat without messages",
        '{"custom_id": "a", "url": "/v1/chat/completions", "body": {"prompt": "x"}}',
        ["messages"],
    ),
    (
        "batch completions without prompt",
        '{"custom_id": "a", "url": "/v1/completions", '
        '"body": {"messages": [{"role": "user", "content": "x"}]}}',
        ["prompt"],
    ),
]


@pytest.mark.parametrize(
    ("text", "words"), [(t, w) for _, t, w in BAD_LINES], ids=[n for n, _, _ in BAD_LINES]
)
def test_bad_line_is_reported_with_number_and_reason(
    tmp_path: Path, text: str, words: list[str]
) -> None:
    path = write_lines(tmp_path / "in.jsonl", [{"prompt": "ok"}, text, {"prompt": "ok too"}])
    _, entries = read_all(path)
    assert len(entries) == 3
    first, bad, last = entries
    assert isinstance(first, InputItem)
    assert isinstance(last, InputItem)
    assert last.line == 3
    assert isinstance(bad, BadLine)
    assert bad.line == 2
    for word in words:
        assert word.lower() in bad.reason.lower(), (word, bad.reason)


def test_messages_shape_on_completions_endpoint_is_bad(tmp_path: Path) -> None:
    bad = one_line(
        tmp_path, {"messages": [{"role": "user", "content": "x"}]}, endpoint="completions"
    )
    assert isinstance(bad, BadLine)
    assert bad.line == 1
    assert "messages" in bad.reason
    assert "chat" in bad.reason


def test_invalid_utf8_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n\xff\xfe\n{"prompt": "fine"}\n')
    _, entries = read_all(path)
    assert [type(e) for e in entries] == [InputItem, BadLine, BadLine, InputItem]
    for bad in entries[1:3]:
        assert isinstance(bad, BadLine)
        assert "utf-8" in bad.reason.lower()
    assert [e.line for e in entries] == [1, 2, 3, 4]


def test_over_long_line_is_bad_and_the_next_line_still_reads(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    long_line = json.dumps({"prompt": "x" * 500}).encode()
    content = b'{"prompt":"a"}\n' + long_line + b'\n{"id":"after","prompt":"b"}\n'
    path.write_bytes(content)
    reader, entries = read_all(path, max_line_bytes=64)
    assert len(entries) == 3
    first, bad, after = entries
    assert isinstance(first, InputItem)
    assert first.line == 1
    assert isinstance(bad, BadLine)
    assert bad.line == 2
    assert "64" in bad.reason
    assert "long" in bad.reason or "limit" in bad.reason
    assert isinstance(after, InputItem)
    assert after.line == 3
    assert after.item_id == "after"
    assert orjson.loads(after.body) == {"messages": [{"role": "user", "content": "b"}]}
    assert reader.stats.lines == 3
    assert reader.stats.file_digest == hashlib.sha256(content).hexdigest()


def test_very_long_line_over_many_read_chunks(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    long_line = json.dumps({"prompt": "y" * 300_000}).encode()
    content = long_line + b"\n" + b'{"prompt":"b"}\n' + long_line
    path.write_bytes(content)
    reader, entries = read_all(path, max_line_bytes=1000)
    assert [type(e) for e in entries] == [BadLine, InputItem, BadLine]
    assert [e.line for e in entries] == [1, 2, 3]
    assert reader.stats.lines == 3
    assert reader.stats.file_digest == hashlib.sha256(content).hexdigest()


def test_line_exactly_at_the_limit_is_accepted(tmp_path: Path) -> None:
    line = b'{"prompt":"' + b"z" * 20 + b'"}'
    path = tmp_path / "in.jsonl"
    path.write_bytes(line + b"\n" + line + b"z\n")
    _, entries = read_all(path, max_line_bytes=len(line))
    assert isinstance(entries[0], InputItem)
    assert isinstance(entries[1], BadLine)
    assert entries[1].line == 2


# --- blank lines, BOM, CRLF, empty file, stats --------------------------------------------------


def test_blank_and_whitespace_lines_are_skipped_and_listed(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'\n{"prompt":"a"}\n   \n\t\n{"prompt":"b"}\n\r\n')
    reader, entries = read_all(path)
    assert [type(e) for e in entries] == [InputItem, InputItem]
    assert [e.line for e in entries] == [2, 5]
    assert [e.item_id for e in entries if isinstance(e, InputItem)] == ["2", "5"]
    assert reader.stats.blank_lines == [1, 3, 4, 6]
    assert reader.stats.lines == 6


def test_bom_on_first_line_is_accepted(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"id":"a","prompt":"p"}\n{"prompt":"q"}\n')
    _, entries = read_all(path)
    assert len(entries) == 2
    first = entries[0]
    assert isinstance(first, InputItem)
    assert first.item_id == "a"
    assert first.line == 1


def test_crlf_line_endings_are_accepted(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "in.jsonl",
        [{"id": "a", "prompt": "p"}, {"prompt": "q"}, {"id": "c", "prompt": "r"}],
        newline="\r\n",
    )
    assert b"\r\n" in path.read_bytes()
    reader, entries = read_all(path)
    assert [type(e) for e in entries] == [InputItem, InputItem, InputItem]
    assert [e.item_id for e in entries if isinstance(e, InputItem)] == ["a", "2", "c"]
    assert reader.stats.lines == 3


def test_empty_file_yields_nothing(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"")
    reader, entries = read_all(path)
    assert entries == []
    assert reader.stats.lines == 0
    assert reader.stats.blank_lines == []
    assert reader.stats.file_digest == hashlib.sha256(b"").hexdigest()


def test_stats_digest_and_physical_line_count(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    content = b'{"prompt":"a"}\n\nnot json\n{"prompt":"b"}'  # no newline at the end
    path.write_bytes(content)
    reader, entries = read_all(path)
    assert [type(e) for e in entries] == [InputItem, BadLine, InputItem]
    assert [e.line for e in entries] == [1, 3, 4]
    assert reader.stats.lines == 4
    assert reader.stats.blank_lines == [2]
    assert reader.stats.file_digest == hashlib.sha256(content).hexdigest()


def test_missing_file_raises_usage_error_when_iterated(tmp_path: Path) -> None:
    reader = InputReader(tmp_path / "nope.jsonl")
    with pytest.raises(UsageError, match=r"nope\.jsonl"):
        list(reader)


def test_directory_raises_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError):
        list(InputReader(tmp_path))


# --- property: any bytes are read without raising -----------------------------------------------


def physical_lines(content: bytes) -> int:
    if not content:
        return 0
    return content.count(b"\n") + (0 if content.endswith(b"\n") else 1)


def check_any_file(content: bytes) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "in.jsonl"
        path.write_bytes(content)
        reader = input_reader(path, max_line_bytes=64)
        entries = list(reader)
    numbers = [e.line for e in entries]
    assert all(isinstance(e, (InputItem, BadLine)) for e in entries)
    assert numbers == sorted(set(numbers))
    assert all(1 <= n <= reader.stats.lines for n in numbers)
    assert not set(numbers) & set(reader.stats.blank_lines)
    assert reader.stats.lines == physical_lines(content)
    assert reader.stats.file_digest == hashlib.sha256(content).hexdigest()
    for e in entries:
        if isinstance(e, BadLine):
            assert e.reason


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=400))
def test_arbitrary_bytes_never_raise(content: bytes) -> None:
    check_any_file(content)


JSONISH = st.sampled_from(
    [
        '{"prompt": "x"}',
        '{"id": 1, "prompt": "y"}',
        '{"messages": [{"role": "user", "content": "z"}]}',
        '{"custom_id": "c", "url": "/v1/completions", "body": {"prompt": "w"}}',
        "",
        "  ",
        "{",
        "[]",
    ]
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(st.text(max_size=80), JSONISH), max_size=12))
def test_arbitrary_text_lines_never_raise(lines: list[str]) -> None:
    check_any_file("\n".join(lines).encode("utf-8"))
