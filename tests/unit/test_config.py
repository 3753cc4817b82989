"""config.resolve and friends: layering, presets, type checks, API keys, spec files."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import orjson
import pytest

from batchrun.cli_errors import flag
from batchrun.config import RunSpec, load_spec_file, preset_for, resolve
from batchrun.errors import OptionError, UsageError
from batchrun.presets import PRESETS

KEY_VARS = (
    "VLLM_API_KEY",
    "SGLANG_API_KEY",
    "LLAMACPP_API_KEY",
    "GROQ_API_KEY",
    "OPENAI_API_KEY",
    "BATCHRUN_TEST_KEY",
)


@pytest.fixture(autouse=True)
def _no_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """Start every test with none of the key variables set, whatever the shell has."""
    for name in KEY_VARS:
        monkeypatch.delenv(name, raising=False)


# --- precedence ---------------------------------------------------------------------------------


def test_later_layers_win() -> None:
    spec = resolve(
        {"backend": "vllm", "concurrency": 4, "model": "a", "max_attempts": 2},
        {"concurrency": 8, "model": "b"},
        {"model": "c"},
    )
    assert spec.concurrency == 8
    assert spec.model == "c"
    assert spec.max_attempts == 2  # given once, low down, and never overridden
    assert spec.timeout == RunSpec().timeout  # never given: the built-in default


def test_none_means_not_given() -> None:
    spec = resolve(
        {"backend": "vllm", "model": "a", "concurrency": 3, "temperature": 0.5},
        {"model": None, "concurrency": None, "temperature": None, "backend": None},
    )
    assert spec.model == "a"
    assert spec.concurrency == 3
    assert spec.temperature == 0.5
    assert spec.backend == "vllm"


def test_none_for_an_unknown_option_is_ignored() -> None:
    # the command line passes every option, given or not; absent ones are None
    spec = resolve({"backend": "sim"}, {"not_an_option": None})
    assert spec.backend == "sim"


def test_command_line_beats_spec_file_beats_stored_spec(tmp_path: Path) -> None:
    stored = resolve({"backend": "vllm", "model": "stored", "max_tokens": 10}).to_json()
    spec_file = tmp_path / "job.toml"
    spec_file.write_text('model = "from-file"\nmax-tokens = 20\ntimeout = 5\n')
    spec = resolve(stored, load_spec_file(spec_file), {"max_tokens": 30, "model": None})
    assert spec.model == "from-file"
    assert spec.max_tokens == 30
    assert spec.timeout == 5.0
    assert spec.backend == "vllm"


def test_resolving_a_stored_spec_again_gives_the_same_spec(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("GROQ_API_KEY", "k")
    spec = resolve(
        {
            "backend": "groq",
            "model": "llama",
            "concurrency": 7,
            "temperature": 0.1,
            "sim_options": {"x": 1},
        }
    )
    stored = orjson.loads(orjson.dumps(spec.to_json()))
    assert resolve(stored) == spec


# --- presets and backends -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("backend", "base_url", "key_env"),
    [
        ("vllm", "http://127.0.0.1:8000/v1", "VLLM_API_KEY"),
        ("sglang", "http://127.0.0.1:30000/v1", "SGLANG_API_KEY"),
        ("llamacpp", "http://127.0.0.1:8080/v1", "LLAMACPP_API_KEY"),
        ("ollama", "http://127.0.0.1:11434/v1", None),
        ("sim", "http://sim.batchrun.invalid/v1", None),
    ],
)
def test_backend_preset_fills_base_url_and_key_env(
    backend: str, base_url: str, key_env: str | None
) -> None:
    spec = resolve({"backend": backend})
    assert spec.backend == backend
    assert spec.base_url == base_url
    assert spec.api_key_env == key_env
    assert preset_for(spec) is PRESETS[backend]


@pytest.mark.parametrize(
    ("backend", "base_url", "key_env"),
    [
        ("groq", "https://api.groq.com/openai/v1", "GROQ_API_KEY"),
        ("openai", "https://api.openai.com/v1", "OPENAI_API_KEY"),
    ],
)
def test_hosted_presets_with_key_set(
    monkeypatch: pytest.MonkeyPatch, backend: str, base_url: str, key_env: str
) -> None:
    monkeypatch.setenv(key_env, "sk-test")
    spec = resolve({"backend": backend})
    assert spec.base_url == base_url
    assert spec.api_key_env == key_env
    assert spec.api_key() == "sk-test"


def test_explicit_values_beat_the_preset() -> None:
    spec = resolve(
        {"backend": "vllm", "base_url": "http://gpu-box:9000/v1/", "api_key_env": "MY_KEY"}
    )
    assert spec.backend == "vllm"
    assert spec.base_url == "http://gpu-box:9000/v1"  # trailing slash removed
    assert spec.api_key_env == "MY_KEY"


def test_base_url_alone_means_custom() -> None:
    spec = resolve({"base_url": "http://10.0.0.5:8000/v1/"})
    assert spec.backend == "custom"
    assert spec.base_url == "http://10.0.0.5:8000/v1"
    assert spec.api_key_env is None


@pytest.mark.parametrize("layers", [(), ({},), ({"model": "m", "concurrency": 2},)])
def test_no_backend_and_no_base_url_is_a_usage_error(layers: tuple[dict[str, Any], ...]) -> None:
    with pytest.raises(OptionError, match="give backend NAME") as info:
        resolve(*layers)
    # the CLI says the same with its flags
    assert "give --backend NAME" in info.value.naming(
        flag
    ) and "--base-url URL" in info.value.naming(flag)


def test_custom_backend_needs_base_url() -> None:
    with pytest.raises(OptionError, match="backend custom needs base_url") as info:
        resolve({"backend": "custom"})
    assert info.value.naming(flag) == "--backend custom needs --base-url"


def test_unknown_backend() -> None:
    with pytest.raises(UsageError, match="backend") as info:
        resolve({"backend": "tgi-nope"})
    assert "tgi-nope" in str(info.value)


def test_unknown_option_is_named() -> None:
    with pytest.raises(UsageError, match="concurrancy"):
        resolve({"backend": "sim", "concurrancy": 4})


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("concurrency", "x"),
        ("concurrency", True),
        ("concurrency", 2.5),
        ("max_attempts", False),
        ("max_tokens", "100"),
        ("max_line_bytes", True),
        ("timeout", "fast"),
        ("timeout", True),
        ("temperature", "0.5"),
        ("top_p", [0.9]),
        ("stream", 1),
        ("stream", "yes"),
        ("skip_invalid", "true"),
        ("model", 5),
        ("base_url", 8000),
        ("endpoint", ["chat"]),
    ],
)
def test_wrong_type_names_the_option(option: str, value: Any) -> None:
    with pytest.raises(UsageError, match=option):
        resolve({"backend": "sim", option: value})


@pytest.mark.parametrize("value", ["fast", ["latency", 1], 3])
def test_sim_options_must_be_a_table(value: Any) -> None:
    # e.g. `sim-options = "fast"` in a spec TOML: refused by name here, not a crash later
    with pytest.raises(UsageError, match="sim_options"):
        resolve({"backend": "sim", "sim_options": value})


def test_wrong_type_in_a_lower_layer_is_still_refused() -> None:
    with pytest.raises(UsageError, match="concurrency"):
        resolve({"backend": "sim", "concurrency": "x"}, {"concurrency": 4})


def test_int_is_accepted_for_float_options_and_becomes_float() -> None:
    spec = resolve({"backend": "sim", "timeout": 30, "temperature": 1, "top_p": 0.5})
    assert spec.timeout == 30.0
    assert isinstance(spec.timeout, float)
    assert isinstance(spec.temperature, float)
    assert spec.top_p == 0.5


@pytest.mark.parametrize(
    ("option", "value", "word"),
    [
        ("endpoint", "embeddings", "endpoint"),
        ("concurrency", 0, "concurrency"),
        ("max_attempts", 0, "max_attempts must be at least 1"),
        ("timeout", 0, "timeout"),
        ("timeout", -1.5, "timeout"),
    ],
)
def test_out_of_range_values(option: str, value: Any, word: str) -> None:
    with pytest.raises(UsageError, match=word):
        resolve({"backend": "sim", option: value})


def test_spec_is_frozen() -> None:
    spec = resolve({"backend": "sim"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.model = "x"  # type: ignore[misc]


# --- API keys -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("backend", "var"), [("groq", "GROQ_API_KEY"), ("openai", "OPENAI_API_KEY")]
)
def test_hosted_backend_without_key_names_the_variable(backend: str, var: str) -> None:
    with pytest.raises(UsageError, match=var):
        resolve({"backend": backend})


def test_empty_key_counts_as_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GROQ_API_KEY", "")
    with pytest.raises(UsageError, match="GROQ_API_KEY"):
        resolve({"backend": "groq"})


def test_hosted_backend_with_another_key_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(UsageError, match="BATCHRUN_TEST_KEY"):
        resolve({"backend": "groq", "api_key_env": "BATCHRUN_TEST_KEY"})
    monkeypatch.setenv("BATCHRUN_TEST_KEY", "sk-other")
    spec = resolve({"backend": "groq", "api_key_env": "BATCHRUN_TEST_KEY"})
    assert spec.api_key() == "sk-other"


def test_local_backend_does_not_need_a_key() -> None:
    spec = resolve({"backend": "vllm"})
    assert spec.api_key() is None


def test_api_key_is_read_at_call_time(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = resolve({"backend": "vllm"})
    assert spec.api_key() is None
    monkeypatch.setenv("VLLM_API_KEY", "first")
    assert spec.api_key() == "first"
    monkeypatch.setenv("VLLM_API_KEY", "second")
    assert spec.api_key() == "second"
    monkeypatch.delenv("VLLM_API_KEY")
    assert spec.api_key() is None


def test_no_key_variable_means_no_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "should-not-be-used")
    spec = resolve({"backend": "ollama"})
    assert spec.api_key_env is None
    assert spec.api_key() is None


def test_to_json_never_holds_the_key_value(monkeypatch: pytest.MonkeyPatch) -> None:
    secret = "sk-DISTINCTIVE-secret-7f3a9c"
    monkeypatch.setenv("GROQ_API_KEY", secret)
    spec = resolve({"backend": "groq", "model": "llama-3.1-8b"})
    assert spec.api_key() == secret
    dumped = orjson.dumps(spec.to_json())
    assert secret.encode() not in dumped
    assert b"GROQ_API_KEY" in dumped  # the name of the variable is kept
    assert secret not in repr(spec)


def test_missing_key_error_does_not_leak_other_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-leak-check-123")
    with pytest.raises(UsageError) as info:
        resolve({"backend": "groq"})
    assert "sk-leak-check-123" not in str(info.value)


# --- spec files ---------------------------------------------------------------------------------


def test_load_spec_file_with_dashed_keys(tmp_path: Path) -> None:
    path = tmp_path / "job.toml"
    path.write_text(
        'backend = "llamacpp"\n'
        'base-url = "http://127.0.0.1:9999/v1"\n'
        'api-key-env = "BATCHRUN_TEST_KEY"\n'
        "max-attempts = 3\n"
        "max_tokens = 64\n"
        "temperature = 0.3\n"
        "skip-invalid = true\n",
        encoding="utf-8",
    )
    data = load_spec_file(path)
    assert data == {
        "backend": "llamacpp",
        "base_url": "http://127.0.0.1:9999/v1",
        "api_key_env": "BATCHRUN_TEST_KEY",
        "max_attempts": 3,
        "max_tokens": 64,
        "temperature": 0.3,
        "skip_invalid": True,
    }
    spec = resolve(data)
    assert spec.backend == "llamacpp"
    assert spec.base_url == "http://127.0.0.1:9999/v1"
    assert spec.max_attempts == 3
    assert spec.skip_invalid is True


def test_a_spec_files_schema_path_is_read_beside_the_spec(tmp_path: Path) -> None:
    # `schema = "product.schema.json"` in jobs/nightly.toml is jobs/product.schema.json,
    # whatever folder cron runs the command from; an absolute or ~ path is kept.
    folder = tmp_path / "jobs"
    folder.mkdir()
    (folder / "nightly.toml").write_text('schema = "product.schema.json"\n')
    assert load_spec_file(folder / "nightly.toml")["schema"] == str(folder / "product.schema.json")
    (folder / "abs.toml").write_text('schema = "/srv/s.json"\n')
    assert load_spec_file(folder / "abs.toml")["schema"] == "/srv/s.json"
    (folder / "home.toml").write_text('schema = "~/s.json"\n')
    assert load_spec_file(folder / "home.toml")["schema"] == "~/s.json"


def test_spec_file_typo_is_named_by_resolve(tmp_path: Path) -> None:
    path = tmp_path / "job.toml"
    path.write_text('backend = "sim"\nmax-atempts = 3\n', encoding="utf-8")
    with pytest.raises(UsageError, match="max_atempts"):
        resolve(load_spec_file(path))


def test_spec_file_wrong_type_is_named_by_resolve(tmp_path: Path) -> None:
    path = tmp_path / "job.toml"
    path.write_text('backend = "sim"\nconcurrency = "lots"\n', encoding="utf-8")
    with pytest.raises(UsageError, match="concurrency"):
        resolve(load_spec_file(path))


def test_bad_toml_is_a_usage_error(tmp_path: Path) -> None:
    path = tmp_path / "job.toml"
    path.write_text('backend = "sim\nmodel = \n', encoding="utf-8")
    with pytest.raises(UsageError, match="TOML"):
        load_spec_file(path)


def test_non_utf8_spec_file_is_a_usage_error(tmp_path: Path) -> None:
    path = tmp_path / "job.toml"
    path.write_bytes(b'model = "caf\xe9"\n')
    with pytest.raises(UsageError):
        load_spec_file(path)


def test_missing_spec_file_is_a_usage_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="not found"):
        load_spec_file(tmp_path / "absent.toml")


# --- request defaults ---------------------------------------------------------------------------


def test_request_defaults_drop_none_values() -> None:
    spec = resolve({"backend": "sim", "model": "gemma", "max_tokens": 128})
    assert spec.request_defaults() == {"model": "gemma", "max_tokens": 128}


def test_request_defaults_keep_zero_values() -> None:
    spec = resolve({"backend": "sim", "temperature": 0.0, "top_p": 1.0})
    assert spec.request_defaults() == {"temperature": 0.0, "top_p": 1.0}


def test_request_defaults_empty_when_nothing_given() -> None:
    assert resolve({"backend": "sim"}).request_defaults() == {}


def test_request_defaults_all_fields() -> None:
    spec = resolve(
        {"backend": "sim", "model": "m", "max_tokens": 5, "temperature": 0.2, "top_p": 0.9}
    )
    assert spec.request_defaults() == {
        "model": "m",
        "max_tokens": 5,
        "temperature": 0.2,
        "top_p": 0.9,
    }


def test_a_stored_spec_is_read_back_whatever_rules_came_since() -> None:
    # export and cancel read a job's spec back: a rule added since it was stored (or a key
    # variable not set here) must not lock its results away; a run with it is still refused.
    old = {
        "backend": "vllm",
        "max_tokens": 4096,
        "on_truncate": "retry-longer",
        "temperature": -1.0,
        "max_cost": 5.0,
        "price_out": 2.0,
    }
    assert resolve(old, endpoint_required=False, stored=True).temperature == -1.0
    with pytest.raises(UsageError):
        resolve(old)


def test_a_key_variable_given_with_a_url_does_not_follow_a_move_to_another_host() -> None:
    # a custom job at gpu.lan with its own key, resumed with another preset on another host:
    # the key named for gpu.lan is not sent there unless named again
    stored = {"backend": "custom", "base_url": "http://gpu.lan:8000/v1", "api_key_env": "GPU_KEY"}
    moved = resolve(stored, {"backend": "vllm", "base_url": "http://other:8000/v1"})
    assert (moved.base_url, moved.api_key_env) == ("http://other:8000/v1", "VLLM_API_KEY")
    kept = resolve(stored, {"backend": "vllm"})  # the same server, with vLLM's quirks
    assert (kept.base_url, kept.api_key_env) == ("http://gpu.lan:8000/v1", "GPU_KEY")


def test_a_load_page_url_goes_with_the_server_it_was_given_for() -> None:
    # A job run with --server-metrics http://old:8000/metrics, resumed on another host: auto
    # reads the new server's page, not the old one's (the options review's suspicion).
    stored = {
        "backend": "vllm",
        "base_url": "http://old:8000/v1",
        "server_metrics": "http://old:8000/metrics",
    }
    assert resolve(stored, {"base_url": "http://new:8000/v1"}).server_metrics == "auto"
    assert resolve(stored, {"base_url": "http://old:8000/v1/"}).server_metrics.startswith(
        "http://old"
    )
    named = {"base_url": "http://new:8000/v1", "server_metrics": "http://new:9000/metrics"}
    assert resolve(stored, named).server_metrics == "http://new:9000/metrics"
    assert resolve(stored, {"backend": "sglang"}).server_metrics == "auto"


def test_switching_backend_on_resume_drops_the_old_presets_url_and_key_variable() -> None:
    stored = resolve({"backend": "vllm"}).to_json()
    switched = resolve(stored, {"backend": "ollama"})
    assert switched.base_url == PRESETS["ollama"].base_url
    assert switched.api_key_env is None
    kept = resolve(stored, {"concurrency": 4})
    assert kept.base_url == PRESETS["vllm"].base_url and kept.api_key_env == "VLLM_API_KEY"


@pytest.mark.parametrize(
    ("given", "expected"), [("auto", "auto"), ("AUTO", "auto"), ("8", 8), (12, 12)]
)
def test_concurrency_is_a_number_or_auto(given: object, expected: object) -> None:
    spec = resolve({"backend": "sim", "concurrency": given})
    assert spec.concurrency == expected
    assert spec.adaptive == (expected == "auto")
    assert spec.most_in_flight == (spec.max_concurrency if expected == "auto" else expected)


@pytest.mark.parametrize("given", ["fast", "0", 0, -3, True])
def test_bad_concurrency_is_refused(given: object) -> None:
    with pytest.raises(UsageError, match="concurrency"):
        resolve({"backend": "sim", "concurrency": given})


def test_rate_options_must_be_positive() -> None:
    with pytest.raises(UsageError, match="rpm"):
        resolve({"backend": "sim", "rpm": 0.0})
    assert resolve({"backend": "sim", "tpm": 1000}).tpm == 1000.0


def test_concurrency_is_adaptive_unless_a_number_is_given() -> None:
    spec = resolve({"backend": "vllm"})
    assert spec.concurrency == "auto" and spec.adaptive
    assert spec.most_in_flight == spec.max_concurrency == 256
    fixed = resolve({"backend": "vllm", "concurrency": "12"})
    assert fixed.concurrency == 12 and not fixed.adaptive and fixed.most_in_flight == 12


def test_structured_output_options_are_checked() -> None:
    spec = resolve({"backend": "llamacpp"})
    assert (spec.guided, spec.repair_attempts, spec.on_truncate) == (True, 1, "fail")
    assert PRESETS["llamacpp"].guided_style == "json_object"
    assert PRESETS["vllm"].guided_style == "json_schema"
    for bad, message in [
        ({"on_truncate": "grow"}, "on_truncate"),
        ({"repair_attempts": -1}, "repair_attempts"),
        ({"max_tokens_cap": 0}, "max_tokens_cap"),
        # a cap at or below max_tokens: retry-longer would never retry (the options review)
        ({"on_truncate": "retry-longer", "max_tokens": 512, "max_tokens_cap": 512}, "cap"),
        ({"temperature": -0.5}, "temperature"),  # every server refuses: every line would fail
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": 0.0}, "top_p"),
    ]:
        with pytest.raises(UsageError, match=message):
            resolve({"backend": "vllm", **bad})
    kept = resolve({"backend": "vllm", "max_tokens": 512, "temperature": 0.0, "top_p": 1.0})
    assert (kept.temperature, kept.top_p, kept.max_tokens_cap) == (0.0, 1.0, 4096)


@pytest.mark.parametrize(
    "url", ["ftp://host/metrics", "http://host/metrics\n", "http://host/ metrics", "http://h/\x07"]
)
def test_a_server_metrics_url_must_be_one_plain_http_url(url: str) -> None:
    with pytest.raises(OptionError, match="server_metrics"):
        resolve({"backend": "sim", "server_metrics": url})
    assert resolve({"backend": "sim", "server_metrics": "http://host:8000/slots"})
