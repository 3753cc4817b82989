"""A hostile review of how a run's options are chosen and kept: presets, `--spec` TOML files,
command-line options, their precedence, and what `resume` does with options given again or
changed. Each test fails on the code it was written against and shows a defect a user would
hit; it passes once the defect is fixed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner

import batchrun
from batchrun import routes
from batchrun.backends.build import sim_config
from batchrun.cli import main
from batchrun.sim import SimModel, SimTransport
from tests.hostile.server import Behaviour, serving

SIM: dict[str, Any] = {"backend": "sim", "sim_options": {"ttft_ms": 0.0, "tpot_ms": 0.0}}
ROOT = Path(__file__).resolve().parents[2]


def write_lines(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


class Sent:
    """Every request the job sent, whatever its endpoint: method, URL, headers, JSON body.
    Each endpoint is answered by the in-process simulator, as if it were that server."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, dict[str, str], Any]] = []

    @property
    def posts(self) -> list[tuple[str, dict[str, str], dict[str, Any]]]:
        return [(url, h, body) for method, url, h, body in self.requests if method == "POST"]


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> Sent:
    record = Sent()

    class Recording(SimTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            raw = await request.aread()
            headers = {k.lower(): v for k, v in request.headers.items()}
            body = json.loads(raw) if raw else None
            record.requests.append((request.method, str(request.url), headers, body))
            return await super().handle_async_request(request)

    # the seam where a job's endpoint gets its transport (None: the real HTTP engine)
    monkeypatch.setattr(routes, "sim_transport", lambda spec: Recording(SimModel(sim_config(spec))))
    return record


def run_cli(home: Path, *args: str) -> Any:
    return CliRunner().invoke(main, ["--home", str(home), *args])


# --- budgets -------------------------------------------------------------------------------------


def test_max_cost_with_only_a_prompt_price_is_refused(tmp_path: Path) -> None:
    # README: "`--max-cost X` with `--price-in P` and `--price-out P`", and the error itself says
    # "{max_cost} needs {price_in} and {price_out}". But config._validate only refuses when BOTH
    # are missing: `--max-cost 5 --price-in 3` (price-out forgotten) is taken, every output token
    # is then priced at 0, and the job can spend far past the $5 the user set as its ceiling.
    rows = write_lines(tmp_path / "in.jsonl", [{"id": "a", "prompt": "hi"}])
    with pytest.raises(batchrun.UsageError, match="price_out"):
        batchrun.submit(rows, home=tmp_path, run=False, max_cost=5.0, price_in=3.0, max_tokens=64)


# --- reuse under options changed at resume -----------------------------------------------------


def test_reuse_never_hands_on_an_answer_made_at_another_temperature(
    tmp_path: Path, sent: Sent
) -> None:
    # Job x is loaded with --temperature 0 (the submit-time default goes into each line's
    # digest) and run with `resume x --temperature 1.5`: its answer is made at 1.5 and stored
    # under (digest{temperature: 0}, answer_spec{temperature: 1.5}).
    # Job y's line asks for temperature 0 itself; its job default is 1.5. Its digest
    # ({..., temperature: 0}) and its answer options (temperature 1.5) are the same key, so
    # y is handed x's temperature-1.5 sample, while sending it would have asked for 0.
    x = write_lines(tmp_path / "x.jsonl", [{"id": "1", "prompt": "Say one."}])
    y = write_lines(tmp_path / "y.jsonl", [{"id": "1", "prompt": "Say one.", "temperature": 0.0}])
    batchrun.submit(x, job="x", home=tmp_path, run=False, temperature=0.0)
    batchrun.resume("x", home=tmp_path, temperature=1.5, **SIM)
    assert [body["temperature"] for _, _, body in sent.posts] == [1.5]

    report = batchrun.submit(y, job="y", home=tmp_path, temperature=1.5, **SIM)
    assert report.ok
    reused = [r.reused_from for r in batchrun.results("y", home=tmp_path)]
    # y's line must be answered by a request at temperature 0: sent, or copied from one
    asked = [body["temperature"] for _, _, body in sent.posts]
    assert reused == [None] and 0.0 in asked, (reused, asked)


def test_openai_export_names_the_model_that_answered_each_line(tmp_path: Path, sent: Sent) -> None:
    # A job stopped by its budget after 2 of 4 lines under --model model-a, then resumed under
    # --model model-b (README: alone on a job, a resume's options become the job's). The
    # OpenAI-shaped export then says `"model": "model-b"` for the lines model-a answered:
    # outputs.openai_record falls back to the job's *current* model, not the one each answer
    # came from. (The known gap in the README is about several endpoints; this is one.)
    rows = write_lines(
        tmp_path / "in.jsonl", [{"id": f"p{i}", "prompt": f"Say {i}."} for i in range(4)]
    )
    with pytest.raises(batchrun.JobAborted):
        batchrun.submit(
            rows,
            job="j",
            home=tmp_path,
            model="model-a",
            max_tokens=8,
            max_total_tokens=20,
            concurrency=1,
            **SIM,
        )
    batchrun.resume(
        "j", home=tmp_path, model="model-b", max_tokens=8, max_total_tokens=10**6, **SIM
    )
    asked = {body["messages"][-1]["content"]: body["model"] for _, _, body in sent.posts}
    assert set(asked.values()) == {"model-a", "model-b"}  # both models answered some lines

    exported = batchrun.export("j", fmt="openai", home=tmp_path)
    said = {}
    for line in exported.read_text().splitlines():
        record = json.loads(line)
        said[f"Say {record['custom_id'][1:]}."] = record["response"]["body"]["model"]
    assert said == asked


# --- precedence: command line over spec file over preset ----------------------------------------


def test_base_url_on_the_command_line_wins_over_a_spec_files_sim_backend(tmp_path: Path) -> None:
    # jobs/example.toml says `backend = "sim"` and "the command line wins over this file". With
    # `--spec jobs/example.toml --base-url http://real-server/v1` the run still uses the
    # in-process simulator (routes/build pick the transport by backend alone): the real server
    # gets no request, and the job ends `done` with synthetic "[sim:...]" answers, exit 0.
    rows = write_lines(tmp_path / "in.jsonl", [{"id": "a", "prompt": "hi"}])
    spec = tmp_path / "job.toml"
    spec.write_text('backend = "sim"\nmax-tokens = 16\n')
    with serving(Behaviour()) as url:
        report = batchrun.submit(
            rows, job="j", home=tmp_path, spec=spec, base_url=url, model="m", concurrency=1
        )
    assert report.ok
    outputs = [r.output for r in batchrun.results("j", home=tmp_path)]
    assert outputs == ["echo: hi"], outputs  # the scripted server's answer


def test_a_spec_files_base_url_and_key_survive_a_preset_named_on_the_command_line(
    tmp_path: Path, sent: Sent, monkeypatch: pytest.MonkeyPatch
) -> None:
    # config.py: "Precedence, lowest first: built-in defaults < backend preset < ... < a --spec
    # TOML file < the command line"; README: "--base-url and --api-key-env override a preset".
    # A spec file giving base_url and api_key_env, with `--backend vllm` on the command line
    # (for vLLM's quirks), loses both: resolve() drops them when a later layer names a
    # backend, so the job goes to 127.0.0.1:8000 with $VLLM_API_KEY (another server, and
    # another account's key) instead of the spec's server and key.
    monkeypatch.setenv("GPU_BOX_KEY", "team-key-0123456789")
    monkeypatch.setenv("VLLM_API_KEY", "personal-key-987654")
    rows = write_lines(tmp_path / "in.jsonl", [{"id": "a", "prompt": "hi"}])
    spec = tmp_path / "gpu.toml"
    spec.write_text('base_url = "http://gpu-box:8000/v1"\napi_key_env = "GPU_BOX_KEY"\n')
    batchrun.submit(
        rows, job="j", home=tmp_path, spec=spec, backend="vllm", model="m", concurrency=1
    )
    [(url, headers, _body)] = sent.posts
    assert (url, headers.get("authorization")) == (
        "http://gpu-box:8000/v1/chat/completions",
        "Bearer team-key-0123456789",
    )


def test_resume_to_another_base_url_does_not_send_the_hosted_providers_key_there(
    tmp_path: Path, sent: Sent, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A job loaded for OpenAI (`--backend openai`, key in OPENAI_API_KEY) is finished on a
    # local server instead: `resume JOB --base-url http://127.0.0.1:8000/v1 --model m`. The
    # stored preset's key variable is kept (only a new --backend drops it), so the OpenAI key
    # goes to the local server, in clear over plain HTTP. The user named no key for that host.
    monkeypatch.setenv("OPENAI_API_KEY", "sk-proj-secret0123456789abcdef")
    rows = write_lines(tmp_path / "in.jsonl", [{"id": "a", "prompt": "hi"}])
    batchrun.submit(rows, job="j", home=tmp_path, run=False, backend="openai", model="gpt-4o-mini")
    batchrun.resume("j", home=tmp_path, base_url="http://127.0.0.1:8000/v1", model="m")
    assert sent.posts
    leaked = [url for url, headers, _ in sent.posts if "sk-proj-secret" in str(headers)]
    assert leaked == []


# --- options the parser takes and the run then trips over --------------------------------------


@pytest.mark.parametrize(
    "flags",
    [
        pytest.param(["--max-attempts", "100000000000000000000"], id="max-attempts-past-64-bits"),
        pytest.param(["--repair-attempts", "100000000000000000000"], id="repair-attempts"),
        pytest.param(["--concurrency", "\u00b2"], id="concurrency-superscript-two"),
        pytest.param(["--concurrency", "\u2466"], id="concurrency-circled-seven"),
    ],
)
def test_an_out_of_range_or_odd_number_is_a_usage_error_not_a_traceback(
    tmp_path: Path, flags: list[str]
) -> None:
    # click's IntRange has no upper bound: a number past 64 bits is taken and then crashes
    # when the spec is stored (orjson: "Integer exceeds 64-bit range", a bare TypeError,
    # exit 1 with a traceback). `--concurrency ²` passes str.isdigit() in config._coerce and
    # then int() raises ValueError: a traceback too.
    rows = write_lines(tmp_path / "in.jsonl", [{"id": "a", "prompt": "hi"}])
    result = run_cli(tmp_path, "submit", str(rows), "--backend", "sim", "-q", *flags)
    assert result.exit_code == 2, (result.exit_code, repr(result.exception), result.output)


def test_a_spec_file_giving_endpoints_as_toml_tables_is_a_usage_error(tmp_path: Path) -> None:
    # `endpoints = [{name = "a", url = "..."}]` is how TOML writes a list of records; config's
    # type check takes any list for `endpoints`, and parse_endpoint then calls .partition on a
    # dict: AttributeError, a traceback, exit 1.
    rows = write_lines(tmp_path / "in.jsonl", [{"id": "a", "prompt": "hi"}])
    spec = tmp_path / "job.toml"
    spec.write_text('endpoints = [{name = "a", url = "http://127.0.0.1:9/v1"}]\n')
    result = run_cli(tmp_path, "submit", str(rows), "--spec", str(spec), "-q")
    assert result.exit_code == 2, (result.exit_code, repr(result.exception), result.output)
    assert "endpoints" in result.output


def test_a_spec_file_naming_one_option_both_ways_is_refused(tmp_path: Path) -> None:
    # TOML refuses a key given twice; batchrun reads `max_tokens` and `max-tokens` as one
    # option and silently keeps whichever comes last (here 4096: the budget's bound is
    # not the 16 the user wrote first). Either value may be the one meant: say so.
    rows = write_lines(tmp_path / "in.jsonl", [{"id": "a", "prompt": "hi"}])
    spec = tmp_path / "job.toml"
    spec.write_text('backend = "sim"\nmax_tokens = 16\nmax-tokens = 4096\n')
    result = run_cli(tmp_path, "submit", str(rows), "--spec", str(spec), "--no-run", "-q")
    assert result.exit_code == 2, result.output
    assert "max" in result.output and "tokens" in result.output


def test_quiet_in_a_spec_file_is_refused_saying_where_it_goes(tmp_path: Path) -> None:
    # README, Commands, listed `--quiet` among the run options a TOML job spec takes "with the
    # same names", and a spec with `quiet = true` was refused as "unknown option 'quiet'".
    # How the command speaks is not the job's: the README no longer lists it, and the error
    # says to give --quiet.
    rows = write_lines(tmp_path / "in.jsonl", [{"id": "a", "prompt": "hi"}])
    spec = tmp_path / "job.toml"
    spec.write_text('backend = "sim"\nquiet = true\n')
    result = run_cli(tmp_path, "submit", str(rows), "--spec", str(spec))
    assert result.exit_code == 2, result.output
    assert "give --quiet instead" in result.output


# --- a number too big for the job ---------------------------------------------------------------


def test_a_big_concurrency_costs_no_memory_for_slots_the_job_cannot_use(tmp_path: Path) -> None:
    # Runner._run_workers starts most_in_flight * 1.25 worker tasks up front, whatever the
    # job's size, about 10 KB each: a one-line job with `--concurrency 100000` took 1 GB and 8 s
    # before its one request; `--max-concurrency 1000000000` (auto) is OOM-killed, and while it
    # starts them (a loop with no checkpoint) it does not hear SIGTERM or Ctrl-C.
    rows = write_lines(tmp_path / "in.jsonl", [{"id": "a", "prompt": "hi"}])
    # VmHWM: this process's own peak (getrusage's ru_maxrss keeps the forking parent's,
    # a pytest process of hundreds of MB by the end of the suite)
    probe = (
        "import atexit, re, runpy, sys\n"
        "hwm = lambda: re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read())[1]\n"
        "atexit.register(lambda: print('PEAK_KB', hwm(), file=sys.stderr))\n"
        "sys.argv = ['batchrun', *sys.argv[1:]]\n"
        "runpy.run_module('batchrun', run_name='__main__')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    args = ["--home", str(tmp_path), "submit", str(rows), "--backend", "sim", "-q"]
    done = subprocess.run(
        [sys.executable, "-c", probe, *args, "--concurrency", "40000"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    peak_mb = int(done.stderr.rsplit("PEAK_KB", 1)[1].split()[0]) / 1024
    assert peak_mb < 200, f"peak RSS {peak_mb:.0f} MB for a one-line job"


# --- reading a job back needs no key ------------------------------------------------------------


def test_export_of_a_job_needs_no_api_key_variable_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A job run with `--api-key-env HuggingFaceToken1` (set in the cron's environment) is
    # exported later from a shell where that variable is not set. export sends nothing, but
    # jobs.job_spec re-validates the stored spec, and endpoints.not_a_name takes an unset
    # mixed-case 16+ character name for a pasted key: "error: --api-key-env names no variable
    # set here and looks like a key", exit 2, no results file, though no key is needed.
    monkeypatch.setenv("HuggingFaceToken1", "hf_value")
    rows = write_lines(tmp_path / "in.jsonl", [{"id": "a", "prompt": "hi"}])
    assert batchrun.submit(rows, job="j", home=tmp_path, api_key_env="HuggingFaceToken1", **SIM).ok
    monkeypatch.delenv("HuggingFaceToken1")
    out = tmp_path / "again.jsonl"
    assert batchrun.export("j", path=out, home=tmp_path) == out
    assert json.loads(out.read_text())["status"] == "done"


# --- secrets in a spec file of the wrong shape ----------------------------------------------------

SECRET_URL = "http://alice:hunter2secret@10.0.0.5:8000/v1"


@pytest.mark.parametrize(
    "line",
    [
        # one endpoint, the list's brackets forgotten: the most natural slip in a spec file
        pytest.param(f'endpoints = "gpu0={SECRET_URL}"', id="endpoints"),
        pytest.param(f'base_url = ["{SECRET_URL}"]', id="base-url"),
        pytest.param('api_key_env = ["sk-proj-hunter2secret0123456789"]', id="api-key-env"),
        # `--endpoint NAME=URL` is the flag; "the same names" in a spec file
        pytest.param(f'backend = "sim"\nendpoint = "gpu0={SECRET_URL}"', id="endpoint"),
    ],
)
def test_a_spec_value_of_the_wrong_type_is_refused_without_echoing_its_secret(
    tmp_path: Path, line: str
) -> None:
    # README: a base URL or an --endpoint URL that cannot be used "is refused before anything
    # runs (exit 2), without echoing it (it may hold a user:password@)", and a key pasted where
    # the variable's name goes "is refused too, and not echoed". config.checked's type error
    # quotes the value whole: "error: --endpoints must be tuple, got
    # 'gpu0=http://alice:hunter2secret@10.0.0.5:8000/v1'" lands on the terminal and in cron.log.
    rows = write_lines(tmp_path / "in.jsonl", [{"id": "a", "prompt": "hi"}])
    spec = tmp_path / "job.toml"
    spec.write_text(line + "\n")
    result = run_cli(tmp_path, "submit", str(rows), "--spec", str(spec), "-q")
    assert result.exit_code == 2, result.output
    assert "hunter2secret" not in result.output, result.output
