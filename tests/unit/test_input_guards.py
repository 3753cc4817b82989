"""InputReader's guards against hostile input: size limits, NUL, nesting, surrogates and ids."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
import pytest

from batchrun.inputs import BadLine, InputItem, InputReader, estimate_tokens
from tests.fakes import input_reader


def read_line(tmp_path: Path, line: str | dict[str, Any], **kwargs: Any) -> InputItem | BadLine:
    """Write one line (str as is, anything else as JSON) and read it back."""
    text = line if isinstance(line, str) else json.dumps(line)
    path = tmp_path / "in.jsonl"
    path.write_text(text + "\n", encoding="utf-8")
    entries = list(input_reader(path, **kwargs))
    assert len(entries) == 1
    return entries[0]


def item(entry: InputItem | BadLine) -> InputItem:
    assert isinstance(entry, InputItem), entry
    return entry


def bad(entry: InputItem | BadLine) -> BadLine:
    assert isinstance(entry, BadLine), entry
    assert entry.line == 1
    return entry


def body_of(entry: InputItem | BadLine) -> dict[str, Any]:
    data: dict[str, Any] = orjson.loads(item(entry).body)
    return data


# --- estimate_tokens ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("chars", "tokens"),
    [(0, 0), (1, 1), (3, 1), (4, 1), (5, 2), (8, 2), (9, 3), (400, 100), (401, 101)],
)
def test_estimate_tokens_is_chars_over_four_rounded_up(chars: int, tokens: int) -> None:
    assert estimate_tokens(chars) == tokens


def test_estimate_tokens_matches_ceil_for_a_range() -> None:
    for chars in range(0, 2_000):
        assert estimate_tokens(chars) == -(-chars // 4) == (chars + 3) // 4
    assert estimate_tokens(10**12 + 1) == 250_000_000_001


# --- --max-input-chars ----------------------------------------------------------------------------


def test_prompt_at_exactly_max_chars_passes(tmp_path: Path) -> None:
    entry = read_line(tmp_path, {"id": "a", "prompt": "x" * 100}, max_input_chars=100)
    assert body_of(entry)["messages"][0]["content"] == "x" * 100


def test_prompt_over_max_chars_is_a_bad_line(tmp_path: Path) -> None:
    entry = bad(read_line(tmp_path, {"id": "a", "prompt": "x" * 101}, max_input_chars=100))
    assert "--max-input-chars" in entry.reason
    assert "100" in entry.reason
    assert "101 characters" in entry.reason


def test_max_chars_counts_characters_not_bytes(tmp_path: Path) -> None:
    prompt = "é" * 50  # 100 bytes of UTF-8, 50 characters
    assert item(read_line(tmp_path, {"prompt": prompt}, max_input_chars=50))
    entry = bad(read_line(tmp_path, {"prompt": prompt + "!"}, max_input_chars=50))
    assert "51 characters" in entry.reason


def test_max_chars_sums_all_messages(tmp_path: Path) -> None:
    line = {
        "messages": [
            {"role": "system", "content": "s" * 30},
            {"role": "user", "content": "u" * 30},
            {"role": "assistant", "content": "a" * 30},
            {"role": "user", "content": "v" * 10},
        ]
    }
    assert item(read_line(tmp_path, line, max_input_chars=100))
    entry = bad(read_line(tmp_path, line, max_input_chars=99))
    assert "100 characters" in entry.reason
    assert "--max-input-chars 99" in entry.reason


def test_max_chars_counts_text_parts_of_content_arrays(tmp_path: Path) -> None:
    line = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "a" * 40},
                    {"type": "image_url", "image_url": {"url": "https://example.invalid/x.png"}},
                    {"type": "text", "text": "b" * 20},
                ],
            },
            {"role": "user", "content": "c" * 10},
        ]
    }
    entry = item(read_line(tmp_path, line, max_input_chars=70))
    assert orjson.loads(entry.body)["messages"] == line["messages"]
    too_long = bad(read_line(tmp_path, line, max_input_chars=69))
    assert "70 characters" in too_long.reason


def test_max_chars_ignores_meta_and_request_fields(tmp_path: Path) -> None:
    line = {
        "id": "m",
        "prompt": "p" * 10,
        "note": "n" * 1000,
        "stop": ["s" * 500],
        "model": "m" * 200,
    }
    entry = item(read_line(tmp_path, line, max_input_chars=10, max_input_tokens=3))
    assert orjson.loads(entry.meta or b"null") == {"note": "n" * 1000}


def test_max_chars_applies_to_completions_and_batch_lines(tmp_path: Path) -> None:
    assert item(
        read_line(tmp_path, {"prompt": "x" * 20}, endpoint="completions", max_input_chars=20)
    )
    entry = bad(
        read_line(tmp_path, {"prompt": "x" * 21}, endpoint="completions", max_input_chars=20)
    )
    assert "21 characters" in entry.reason
    batch = {
        "custom_id": "b1",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "m", "messages": [{"role": "user", "content": "y" * 21}]},
    }
    entry = bad(read_line(tmp_path, batch, max_input_chars=20))
    assert "--max-input-chars" in entry.reason and "21 characters" in entry.reason
    batch_completion = {
        "custom_id": "b2",
        "url": "/v1/completions",
        "body": {"model": "m", "prompt": "z" * 20},
    }
    assert item(read_line(tmp_path, batch_completion, max_input_chars=20)).item_id == "b2"


def test_without_limits_long_prompts_pass(tmp_path: Path) -> None:
    assert item(read_line(tmp_path, {"prompt": "x" * 200_000}))


# --- --max-input-tokens ---------------------------------------------------------------------------


def test_prompt_at_exactly_max_tokens_passes(tmp_path: Path) -> None:
    # 40 characters are about 10 tokens
    assert item(read_line(tmp_path, {"prompt": "x" * 40}, max_input_tokens=10))


def test_prompt_over_max_tokens_is_a_bad_line(tmp_path: Path) -> None:
    entry = bad(read_line(tmp_path, {"prompt": "x" * 41}, max_input_tokens=10))
    assert "--max-input-tokens 10" in entry.reason
    assert "about 11 tokens" in entry.reason
    assert "41 characters" in entry.reason


def test_max_tokens_counts_content_parts(tmp_path: Path) -> None:
    line = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "a" * 21}]},
            {"role": "user", "content": [{"type": "text", "text": "b" * 20}]},
        ]
    }
    assert item(read_line(tmp_path, line, max_input_tokens=11))  # 41 chars: 11 tokens
    entry = bad(read_line(tmp_path, line, max_input_tokens=10))
    assert "about 11 tokens" in entry.reason


def test_both_limits_together(tmp_path: Path) -> None:
    limits = {"max_input_chars": 100, "max_input_tokens": 20}
    assert item(read_line(tmp_path, {"prompt": "x" * 80}, **limits))
    by_tokens = bad(read_line(tmp_path, {"prompt": "x" * 81}, **limits))
    assert "--max-input-tokens 20" in by_tokens.reason
    by_chars = bad(
        read_line(tmp_path, {"prompt": "x" * 101}, max_input_chars=100, max_input_tokens=1000)
    )
    assert "--max-input-chars 100" in by_chars.reason


def test_limits_report_each_line_by_number(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    lines = [{"id": str(i), "prompt": "x" * (5 + i)} for i in range(10)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    entries = list(input_reader(path, max_input_chars=9))
    assert [type(e).__name__ for e in entries] == ["InputItem"] * 5 + ["BadLine"] * 5
    assert [e.line for e in entries if isinstance(e, BadLine)] == [6, 7, 8, 9, 10]


# --- NUL characters -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "line",
    [
        {"prompt": "before\u0000after"},
        {"prompt": "\u0000"},
        {"messages": [{"role": "system", "content": "ok"}, {"role": "user", "content": "a\x00"}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "x\u0000y"}]}]},
        {
            "custom_id": "c",
            "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "nul\u0000"}]},
        },
    ],
    ids=["prompt", "only-nul", "message", "content-part", "batch"],
)
def test_escaped_nul_in_the_prompt_is_a_bad_line(tmp_path: Path, line: dict[str, Any]) -> None:
    text = json.dumps(line)
    assert "\\u0000" in text and "\x00" not in text  # escaped in the file, not a raw byte
    entry = bad(read_line(tmp_path, text))
    assert "NUL" in entry.reason


def test_escaped_nul_in_a_completions_prompt_is_a_bad_line(tmp_path: Path) -> None:
    entry = bad(read_line(tmp_path, '{"prompt": "a\\u0000b"}', endpoint="completions"))
    assert "NUL" in entry.reason


def test_literal_backslash_u0000_text_is_not_rejected(tmp_path: Path) -> None:
    line = '{"id": "lit", "prompt": "the escape \\\\u0000 is six characters"}'
    entry = item(read_line(tmp_path, line))
    content = orjson.loads(entry.body)["messages"][0]["content"]
    assert content == "the escape \\u0000 is six characters"
    assert "\x00" not in content
    assert len("\\u0000") == 6


# --- deep nesting ---------------------------------------------------------------------------------


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def deep(template: str, depth: int) -> str:
    """The template with NEST replaced by `depth` levels of nested arrays."""
    assert "NEST" in template
    return template.replace("NEST", nested(depth))


@pytest.mark.parametrize("depth", [5_000, 1_100, 1_000, 300, 254, 100])
@pytest.mark.parametrize(
    "template",
    [
        '{"id": "n", "prompt": "hi", "meta": NEST}',
        '{"id": "n", "messages": [{"role": "user", "content": NEST}]}',
        '{"id": "n", "messages": [{"role": "user", "content": '
        '[{"type": "text", "text": "t"}, NEST]}]}',
        '{"id": "n", "prompt": NEST}',
        '{"id": NEST, "prompt": "hi"}',
        '{"id": "n", "prompt": "hi", "response_format": {"schema": NEST}}',
        '{"custom_id": "n", "url": "/v1/chat/completions", "body": {"messages": NEST}}',
    ],
    ids=["meta", "content", "content-part", "prompt", "id", "request-field", "batch-body"],
)
def test_deep_nesting_never_raises(tmp_path: Path, template: str, depth: int) -> None:
    line = deep(template, depth)
    entry = read_line(tmp_path, line, max_input_chars=1_000, max_input_tokens=1_000)
    assert isinstance(entry, (InputItem, BadLine))
    if isinstance(entry, BadLine):
        assert entry.line == 1
        assert entry.reason
    else:  # what is kept must be valid JSON again
        orjson.loads(entry.body)
        if entry.meta is not None:
            orjson.loads(entry.meta)


def test_5000_levels_in_meta_is_a_bad_line(tmp_path: Path) -> None:
    entry = bad(read_line(tmp_path, deep('{"id": "n", "prompt": "hi", "meta": NEST}', 5_000)))
    assert "JSON" in entry.reason


def test_5000_levels_in_message_content_is_a_bad_line(tmp_path: Path) -> None:
    line = deep('{"id": "n", "messages": [{"role": "user", "content": NEST}]}', 5_000)
    entry = bad(read_line(tmp_path, line))
    assert "JSON" in entry.reason


def test_deep_nesting_does_not_stop_the_next_lines(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    lines = [
        '{"id": "a", "prompt": "one"}',
        deep('{"id": "deep", "prompt": "hi", "meta": NEST}', 5_000),
        deep('{"id": "mid", "prompt": "hi", "meta": NEST}', 500),
        '{"id": "b", "prompt": "two"}',
    ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    entries = list(InputReader(path))
    assert [e.line for e in entries] == [1, 2, 3, 4]
    assert isinstance(entries[0], InputItem) and entries[0].item_id == "a"
    assert isinstance(entries[1], BadLine)
    assert isinstance(entries[2], (InputItem, BadLine))
    assert isinstance(entries[3], InputItem) and entries[3].item_id == "b"


# --- lone surrogates ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "line",
    [
        '{"prompt": "\\ud800"}',
        '{"prompt": "before \\ud800 after"}',
        '{"prompt": "\\udc00"}',
        '{"prompt": "hi", "note": "\\ud800"}',
        '{"id": "\\ud800", "prompt": "hi"}',
        '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}',
    ],
    ids=["prompt", "inside", "low", "meta", "id", "content-part"],
)
def test_lone_surrogate_is_a_bad_line(tmp_path: Path, line: str) -> None:
    entry = bad(read_line(tmp_path, line))
    assert entry.reason


def test_a_proper_surrogate_pair_is_fine(tmp_path: Path) -> None:
    entry = item(read_line(tmp_path, '{"prompt": "\\ud83d\\ude00"}', max_input_chars=1))
    assert orjson.loads(entry.body)["messages"][0]["content"] == "\U0001f600"


# --- ids ------------------------------------------------------------------------------------------


def _id_line(key: str, value: Any) -> str:
    if key == "id":
        line: dict[str, Any] = {"id": value, "prompt": "hi"}
    else:
        line = {
            "custom_id": value,
            "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "hi"}]},
        }
    return json.dumps(line)


@pytest.mark.parametrize("value", [10**30, -(10**30), 2**64, -(2**63) - 1])
@pytest.mark.parametrize("key", ["id", "custom_id"])
def test_integer_ids_beyond_64_bits_are_refused_with_the_real_reason(
    tmp_path: Path, key: str, value: int
) -> None:
    # The JSON parser cannot keep such integers exactly (they arrive as floats), so the line is
    # refused with advice rather than silently turned into "1e+30".
    entry = read_line(tmp_path, _id_line(key, value))
    assert isinstance(entry, BadLine)
    assert "too large" in entry.reason and "string" in entry.reason


@pytest.mark.parametrize("value", [0, -1, 7, 2**63 - 1, -(2**63), 2**64 - 1])
@pytest.mark.parametrize("key", ["id", "custom_id"])
def test_integer_ids_are_accepted_as_strings(tmp_path: Path, key: str, value: int) -> None:
    text = _id_line(key, value)
    assert str(value) in text  # written as an integer literal, digit for digit
    assert item(read_line(tmp_path, text)).item_id == str(value)


@pytest.mark.parametrize(
    ("value", "kind"),
    [
        (None, "null"),
        (1.5, "a non-integer number (1.5); write it as a string"),
        (1.0, "a decimal (1.0); write it as an integer or a string"),
        (True, "a boolean"),
        (False, "a boolean"),
        ({"a": 1}, "an object"),
        ([1], "an array"),
    ],
)
@pytest.mark.parametrize("key", ["id", "custom_id"])
def test_non_integer_ids_are_bad_lines(tmp_path: Path, key: str, value: Any, kind: str) -> None:
    entry = bad(read_line(tmp_path, _id_line(key, value)))
    assert key in entry.reason
    assert kind in entry.reason


@pytest.mark.parametrize("value", ["", "   "])
def test_empty_string_ids_are_bad_lines(tmp_path: Path, value: str) -> None:
    entry = bad(read_line(tmp_path, {"id": value, "prompt": "hi"}))
    assert "empty" in entry.reason


def test_every_prompt_field_of_a_batch_body_is_measured(tmp_path: Path) -> None:
    body = {
        "prompt": "hi",
        "messages": [{"role": "user", "content": "x" * 500 + "\u0000"}],
    }
    line = json.dumps({"custom_id": "b", "url": "/v1/chat/completions", "body": body})
    entry = read_line(tmp_path, line, max_input_chars=100)
    assert isinstance(entry, BadLine) and "NUL" in entry.reason
    body["messages"] = [{"role": "user", "content": "x" * 500}]
    line = json.dumps({"custom_id": "b", "url": "/v1/chat/completions", "body": body})
    entry = read_line(tmp_path, line, max_input_chars=100)
    assert isinstance(entry, BadLine) and "502 characters" in entry.reason
