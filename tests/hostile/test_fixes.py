"""Hostile review of the fixes made on 4 December (db040d7..): where a fix is wrong,
incomplete, or breaks something that worked. Each test fails on the code as reviewed.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import batchrun
from batchrun.errors import UsageError
from tests.hostile.test_bench import virtual  # noqa: F401  (the virtual-time fixture)
from tests.hostile.test_structured import run_answering, schema_file

# --- 1. strict JSON: a refused value is "never changed", yet an inner one is taken instead ----


@pytest.mark.anyio
@pytest.mark.parametrize(
    "text",
    [
        '{"price": NaN, "previous": {"price": 3}}',
        '{"price": 123456789012345678901234567890, "previous": {"price": 3}}',
    ],
    ids=["nan", "big-integer"],
)
async def test_a_refused_value_is_not_replaced_by_an_object_nested_inside_it(
    tmp_path: Path, text: str
) -> None:
    # validate.extract_json refuses NaN and integers past 64 bits ("refused rather than
    # changed"), but its prose scan then goes on to the next "{" in the text, which is an
    # object *inside* the refused one: {"price": 3}. It validates, so the item is `done` with
    # parsed {"price": 3}, a value the model never gave as its answer (it said NaN / a huge
    # number). Before the fix NaN came back as null; now it comes back as another price.
    result = await run_answering(tmp_path, text)
    assert [r["status"] for r in result] == ["invalid"] * 3, [
        (r["status"], r["parsed"]) for r in result
    ]


# --- 2. `$ref` checked at submit: data that looks like a $ref refused ---------------------------

# An OpenAPI-fragment extraction schema: its `examples` and `const` are JSON *data* that holds a
# "$ref" key (as OpenAPI documents do), not a reference of the schema. jsonschema validates with
# it fine; batchrun now refuses the schema at submit.
OPENAPI_FRAGMENT: dict[str, Any] = {
    "type": "object",
    "properties": {
        "response": {
            "type": "object",
            "properties": {"$ref": {"type": "string"}},
            "examples": [{"$ref": "#/components/schemas/Pet"}],
        },
        "kind": {"const": {"$ref": "#/components/schemas/Error"}},
    },
    "required": ["response"],
}


def test_a_schema_whose_examples_hold_a_ref_as_data_is_not_refused(tmp_path: Path) -> None:
    # validate._local_refs walks every dict of the schema, keyword or not: a "$ref" string
    # inside `examples`, `const`, `enum` or `default` (instance data) is taken for a
    # reference, looked up, not found, and the job is refused: "has a $ref that points
    # nowhere: #/components/schemas/Pet". The schema is valid and validates answers.
    import jsonschema

    validator = jsonschema.Draft202012Validator(OPENAPI_FRAGMENT)
    assert not list(validator.iter_errors({"response": {"$ref": "x"}}))  # it works
    rows_in = [{"id": "r0", "prompt": "extract the response"}]
    try:
        batchrun.submit(
            rows_in,
            home=tmp_path / "home",
            backend="sim",
            schema=schema_file(tmp_path, OPENAPI_FRAGMENT),
            run=False,
        )
    except UsageError as exc:
        pytest.fail(f"a valid schema refused at submit: {exc}")


# --- 3. a --mode batch run joined in the reuse pass: left joined when it cannot start ----------


@pytest.mark.anyio
async def test_a_batch_run_that_cannot_start_leaves_no_live_worker_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # jobs._batches_first now joins the job as the batch run's worker inside the reuse pass,
    # then calls batch_mode.run_batches, whose release (its `finally`) only covers what comes
    # after its own join. Anything that stops the run between the two (here BatchAPI's key
    # check: a key with a trailing newline, "fix the variable") leaves a worker row that looks
    # live for a whole --lease, with no heartbeat and no run behind it. Meanwhile `status`
    # shows a worker, gc skips the job, budgets are split with it, and the user's next run
    # with another answer option is refused as "being run by 1 other worker". Before the fix
    # the batch run joined only in run_batches, after BatchAPI was built: nothing was left.
    from batchrun import jobs
    from batchrun.config import resolve
    from batchrun.jobs import Home
    from batchrun.ledger import Ledger
    from batchrun.run_state import RunnerSettings
    from batchrun.sim import SimModel, SimTransport

    monkeypatch.setenv("BATCH_KEY", "sk-test-key\n")  # as read from a secrets file
    home = Home.at(tmp_path, None)
    ledger = Ledger(home.ledger_url)
    lines = [{"id": f"p{i}", "prompt": f"prompt number {i}"} for i in range(3)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    options = {"backend": "sim", "mode": "batch", "model": "sim-1", "api_key_env": "BATCH_KEY"}
    spec = resolve({**options, "poll_interval": 0.02})
    jobs.create_job(ledger, "j", tmp_path / "in.jsonl", spec)
    with pytest.raises(UsageError, match="fix the variable"):
        await jobs.run_job(
            ledger,
            home,
            "j",
            spec,
            transport=SimTransport(SimModel()),
            settings=RunnerSettings(drain_timeout=0.0),
            handle_signals=False,
        )
    live = len(ledger.live_workers("j", ttl=spec.lease))
    ledger.close()
    assert live == 0, f"{live} worker(s) left live by a run that never started"


# --- 4. URLs checked at submit: a valid URL refused ------------------------------------------


@pytest.mark.parametrize("url", ["HTTP://127.0.0.1:8000/v1", "Https://api.example.com/v1"])
def test_a_base_url_whose_scheme_is_in_capitals_is_not_refused(url: str) -> None:
    # endpoints.url_problem checks url.startswith(("http://", "https://")): a scheme is
    # case-insensitive (RFC 3986 3.1), httpx sends such a URL as is, and before 4 December's
    # fix batchrun ran it. Now --base-url, --endpoint and a stored job's spec with it are
    # refused: "{base_url} must be an http:// or https:// URL".
    import httpx

    from batchrun.config import resolve
    from batchrun.errors import OptionError

    assert httpx.URL(url).scheme in ("http", "https")  # what the client makes of it
    try:
        spec = resolve({"base_url": url})
    except (OptionError, UsageError) as exc:
        pytest.fail(f"a valid URL refused: {exc}")
    assert spec.base_url.lower().startswith(("http://", "https://"))


# --- 5. an answer kept when the run stops before a follow-up, but not while it is in flight ----


@pytest.mark.anyio
async def test_a_repair_cut_by_the_stop_keeps_the_answer_already_paid_for(tmp_path: Path) -> None:
    # Ctrl-C while an item's repair is on the wire: in-flight requests get --drain-timeout to
    # finish, then are cancelled. A repair of a long answer easily outlasts it. The fix made
    # "the run stops (... Ctrl-C) during a follow-up: the answer already paid for stands"
    # (sender.py) only for a follow-up not yet sent (_Stopped) or refused (FatalError); the
    # cancellation of one in flight goes straight through Sender.process, nothing is
    # recorded, and the item goes back to pending with its paid answer dropped: `resume`
    # pays for the original request again (and for its repair).
    import anyio
    import httpx

    from tests.hostile.test_structured import body, run_stopped_at_a_repair

    originals = 0

    def slow_repair(stop: Callable[[], None]) -> httpx.AsyncBaseTransport:
        class SlowRepair(httpx.AsyncBaseTransport):
            async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
                nonlocal originals
                if len(json.loads(request.content)["messages"]) == 1:
                    originals += 1
                    return httpx.Response(200, json=body("Sorry, I cannot tell the price."))
                stop()  # Ctrl-C while the repair is being answered
                await anyio.sleep(3600)  # a long repair: cut at the drain timeout
                return httpx.Response(200, json=body('{"price": 2}'))

        return SlowRepair()

    with anyio.fail_after(30):
        stats, result = await run_stopped_at_a_repair(tmp_path, slow_repair, drain_timeout=0.05)
    assert stats.interrupted and originals == 1
    assert result["status"] != "pending" and result["output"], (
        f"the paid answer was dropped: status {result['status']}, output {result['output']!r}; "
        "resume sends the original request again"
    )


# --- 6. bench: tokens unknown, yet said as 0 tok/s while it runs ------------------------------


def test_bench_progress_does_not_say_zero_tokens_per_second_when_tokens_are_unknown(
    virtual: Any,  # noqa: F811  (the fixture imported above)
    tmp_path: Path,
) -> None:
    # The fix made a cell's output tok/s unknown (None, '-' in the table, "tokens unknown")
    # where the server says no token count. The line bench prints as each cell ends
    # (run._measure's `done`) still formats `output_throughput or 0`: "4/4 ok, 0 out tok/s",
    # the false figure the fix removed from the table, shown to the user watching the sweep.
    import orjson

    from batchrun.bench.load import LoadPlan
    from batchrun.bench.run import Endpoint, run_bench
    from batchrun.bench.suite import Suite
    from batchrun.config import resolve
    from tests.hostile.test_bench import SHORT, Scripted

    def plain(_body: dict[str, Any], _host: str) -> tuple[int, dict[str, str], Any]:
        message = {"role": "assistant", "content": "A kettle boils water."}
        answer = {"choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}
        return 200, {"content-type": "application/json"}, [(0.3, orjson.dumps(answer))]

    said: list[str] = []

    async def main() -> Any:
        return await run_bench(
            [Endpoint("gpu", resolve({"base_url": "http://gpu.test/v1", "model": "m"}))],
            Suite([SHORT]),
            LoadPlan(levels=(1,), repeat=2, warmup=0),
            tmp_path,
            label="plain",
            selftest=False,
            transport=Scripted(plain),
            say=said.append,
            show=lambda _: None,
        )

    results = virtual(main)
    assert results["cells"][0]["tokens_unknown"] is True  # the cell knows it
    progress = [line for line in said if "ok," in line]
    assert progress and not any("0 out tok/s" in line for line in progress), progress
