"""Job life-cycle helpers: spec checks done before anything is loaded, error unwrapping."""

from __future__ import annotations

from pathlib import Path

import pytest

from batchrun import jobs
from batchrun.backends.build import checked_key, sim_config
from batchrun.config import resolve
from batchrun.errors import JobExists, UsageError, single_error


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"ttft_ms": "fast"}, "ttft_ms must be float"),
        ({"max_output_tokens": 2.5}, "max_output_tokens must be int"),
        ({"tpot_ms": True}, "tpot_ms must be float"),
        ({"no_such": 1}, "unknown option 'no_such'"),
    ],
)
def test_sim_options_are_checked_before_the_job_is_loaded(
    options: dict[str, object], message: str
) -> None:
    with pytest.raises(UsageError, match=message):
        jobs.resolve_for_job(None, {"backend": "sim", "sim_options": options})


def test_good_sim_options_build_the_config() -> None:
    spec = resolve({"backend": "sim", "sim_options": {"ttft_ms": 5, "models": ["a", "b"]}})
    config = sim_config(spec)
    assert config.ttft_ms == 5 and config.models == ("a", "b")


def test_schema_path_is_checked_and_stored_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "s.json").write_text('{"type": "object"}')
    spec = jobs.resolve_for_job(None, {"backend": "sim", "schema": "s.json"})
    assert spec.schema == str(tmp_path / "s.json")
    with pytest.raises(UsageError, match="schema file not found"):
        jobs.resolve_for_job(None, {"backend": "sim", "schema": "missing.json"})


def test_keys_that_cannot_be_a_header_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("K", "sk-abc\n")
    spec = resolve({"backend": "custom", "base_url": "http://x/v1", "api_key_env": "K"})
    with pytest.raises(UsageError, match=r"\$K") as caught:
        checked_key(spec)
    assert "sk-abc" not in str(caught.value)
    monkeypatch.setenv("K", "sk-abc")
    assert checked_key(spec) == "sk-abc"


def test_task_group_errors_are_unwrapped_to_the_batchrun_error() -> None:
    busy = JobExists("job exists")
    group = BaseExceptionGroup("tg", [BaseExceptionGroup("inner", [busy])])
    assert single_error(group) is busy
    bug = ValueError("bug")  # one error alone (a callback's): as raised
    assert single_error(BaseExceptionGroup("tg", [BaseExceptionGroup("in", [bug])])) is bug
    several = BaseExceptionGroup("tg", [ValueError("a"), KeyError("b")])
    assert single_error(several) is several


def test_ids_that_collide_after_string_conversion_are_duplicates(tmp_path: Path) -> None:
    from batchrun.errors import InputError
    from batchrun.ledger import Ledger

    inp = tmp_path / "ids.jsonl"
    inp.write_text(
        '{"id": 5, "prompt": "a"}\n'
        '{"id": "5", "prompt": "b"}\n'
        '{"prompt": "c"}\n'  # no id: its id is its line number, "3"
        '{"id": "3", "prompt": "d"}\n'
    )
    ledger = Ledger(f"sqlite:///{tmp_path / 'l.db'}")
    spec = resolve({"backend": "sim"})
    with pytest.raises(InputError) as caught:
        jobs.create_job(ledger, "ids", inp, spec)
    assert caught.value.problems == [
        (2, "duplicate id '5' (first on line 1)"),
        (4, "duplicate id '3' (first on line 3)"),
    ]


@pytest.mark.parametrize("name", ["nl\n", "a/b", "../x", ".hidden", "", "x" * 101, "tab\t"])
def test_a_job_name_must_match_the_pattern_in_full(name: str) -> None:
    with pytest.raises(UsageError, match="must start with a letter or digit"):
        jobs.check_job_name(name)


def test_a_good_job_name_is_kept() -> None:
    assert jobs.check_job_name("nightly-2026.12.01_a") == "nightly-2026.12.01_a"
