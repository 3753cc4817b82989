"""Structured outputs end to end over the simulator transport: extraction, validation, repair,
constrained decoding and its fallback, truncation, and what status/export report."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import orjson
import pytest

from batchrun import jobs
from batchrun.backends.base import Completion
from batchrun.cli_report import summary_line
from batchrun.errors import InputError
from batchrun.jobs import Home
from batchrun.ledger import Ledger
from batchrun.sim import SimConfig, SimModel, SimTransport
from batchrun.sim.json_answers import instance, json_text
from batchrun.status_view import job_detail, render_detail
from batchrun.structured import Outcome, OutputRules
from batchrun.validate import SchemaCheck, extract_json
from tests.fakes import FakeTime
from tests.unit.test_runner import report, rows, run

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 2},
        "score": {"type": "integer", "minimum": 0, "maximum": 10},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1},
    },
    "required": ["name", "score", "tags"],
    "additionalProperties": False,
}


class Recording(httpx.AsyncBaseTransport):
    """The simulator, keeping every request body it was sent."""

    def __init__(self, config: SimConfig) -> None:
        self.sim = SimTransport(SimModel(config))
        self.bodies: list[dict[str, Any]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "POST":
            self.bodies.append(json.loads(request.content))
        return await self.sim.handle_async_request(request)


def schema_file(tmp_path: Path, schema: dict[str, Any] = SCHEMA) -> str:
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    return str(path)


def sim(**config: Any) -> Recording:
    return Recording(SimConfig(json_schema=SCHEMA, **config))


def valid(value: Any) -> bool:
    return not list(jsonschema.Draft202012Validator(SCHEMA).iter_errors(value))


# --- extraction and validation, pure --------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"a": 1}', {"a": 1}),
        ("  [1, 2]\n", [1, 2]),
        ('Here:\n```json\n{"a": 1}\n```\nDone.', {"a": 1}),
        ('```\n{"a": 2}\n```', {"a": 2}),
        ('Sure! The answer is {"a": {"b": [1, 2]}} and more {"c": 3}.', {"a": {"b": [1, 2]}}),
        ('first a broken {"a": then the real one {"x": true}', {"x": True}),
    ],
)
def test_json_is_found_whole_fenced_or_inside_prose(text: str, expected: Any) -> None:
    assert extract_json(text) == expected


def test_text_without_json_is_an_error() -> None:
    with pytest.raises(ValueError, match="no JSON"):
        extract_json("just words, {not json")


def test_check_names_where_the_schema_is_violated_and_never_accepts_truncation() -> None:
    check = SchemaCheck(SCHEMA)
    ok = check.check('{"name": "ab", "score": 3, "tags": ["x"]}', "stop")
    assert ok.ok and ok.parsed is not None and json.loads(ok.parsed)["score"] == 3
    bad = check.check('{"name": "ab", "score": 11, "tags": ["x"]}', "stop")
    assert not bad.ok and bad.error is not None
    assert bad.error.startswith("schema violation at score")
    cut = check.check('{"name": "ab", "score": 3, "tags": ["x"]}', "length")
    assert not cut.ok and cut.error is not None and cut.error.startswith("truncated")


@pytest.mark.parametrize("seed", range(20))
def test_simulated_valid_answers_validate_and_the_faulty_styles_do_not(seed: int) -> None:
    rng = random.Random(seed)
    assert valid(instance(SCHEMA, rng))
    check = SchemaCheck(SCHEMA)
    for style, ok in [
        ("valid", True),
        ("fenced", True),
        ("prose", True),
        ("broken", False),
        ("violating", False),
    ]:
        assert check.check(json_text(SCHEMA, style, rng), "stop").ok is ok, style


def test_guided_request_takes_the_presets_style() -> None:
    body = {"messages": [{"role": "user", "content": "x"}]}
    chat = OutputRules(schema=SCHEMA, guided_style="json_schema").plan("chat", body).request()
    assert chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": SCHEMA},
    }
    llama = OutputRules(schema=SCHEMA, guided_style="json_object").plan("chat", body).request()
    assert llama["response_format"] == {"type": "json_object", "schema": SCHEMA}
    assert (
        "response_format"
        not in OutputRules(schema=SCHEMA, guided_style=None).plan("chat", body).request()
    )


def test_a_repair_shows_the_model_its_answer_and_the_error() -> None:
    plan = OutputRules(schema=SCHEMA, guided_style=None).plan(
        "completions", {"prompt": "Extract: "}
    )
    bad = Completion('{"name": 1}', "stop", 5, 4, 0.1, None)
    assert plan.judge(bad) is None
    prompt = plan.request()["prompt"]
    assert prompt.startswith('Extract: {"name": 1}')
    assert "schema violation" in prompt and '"required"' in prompt


# --- through the runner ---------------------------------------------------------------------


@pytest.mark.anyio
async def test_guided_requests_carry_the_schema_and_every_answer_validates(
    tmp_path: Path,
) -> None:
    transport = sim(json_styles={"broken": 1.0})  # unconstrained it would always be broken
    ledger, stats, _ = await run(tmp_path, 12, transport, schema=schema_file(tmp_path))
    result = rows(ledger)
    assert [r["status"] for r in result] == ["done"] * 12
    assert all(valid(json.loads(r["parsed"])) for r in result)
    assert all(b["response_format"]["json_schema"]["schema"] == SCHEMA for b in transport.bodies)
    assert stats.repairs == 0 and stats.guided_refused is None


@pytest.mark.anyio
@pytest.mark.parametrize("style", ["valid", "fenced", "prose"])
async def test_unguided_answers_in_fences_or_prose_are_extracted(
    tmp_path: Path, style: str
) -> None:
    transport = sim(json_styles={style: 1.0})
    ledger, stats, _ = await run(tmp_path, 6, transport, schema=schema_file(tmp_path), guided=False)
    result = rows(ledger)
    assert [r["status"] for r in result] == ["done"] * 6
    assert all(valid(json.loads(r["parsed"])) for r in result)
    assert all("response_format" not in b for b in transport.bodies)
    assert stats.repairs == 0 and len(transport.bodies) == 6


@pytest.mark.anyio
@pytest.mark.parametrize("style", ["broken", "violating"])
async def test_a_repair_fixes_broken_and_violating_answers_and_its_cost_is_counted(
    tmp_path: Path, style: str
) -> None:
    transport = sim(json_styles={style: 1.0})
    ledger, stats, _ = await run(tmp_path, 5, transport, schema=schema_file(tmp_path), guided=False)
    result = rows(ledger)
    assert [r["status"] for r in result] == ["done"] * 5
    assert all(valid(json.loads(r["parsed"])) for r in result)
    assert [r["repairs"] for r in result] == [1] * 5
    assert all(r["repair_prompt_tokens"] > 0 and r["repair_completion_tokens"] > 0 for r in result)
    repairs = [b for b in transport.bodies if len(b["messages"]) == 3]
    assert len(repairs) == 5 and all(b["messages"][1]["role"] == "assistant" for b in repairs)
    assert stats.repairs == 5 and stats.retries == 0
    assert stats.repair_tokens == sum(
        r["repair_prompt_tokens"] + r["repair_completion_tokens"] for r in result
    )
    assert "5 repairs" in summary_line(report(ledger.counts("j"), stats))


@pytest.mark.anyio
async def test_when_repairs_fail_the_item_is_invalid_with_its_raw_output_and_error(
    tmp_path: Path,
) -> None:
    transport = sim(json_styles={"broken": 1.0}, repair_fixes=False)
    ledger, stats, _ = await run(
        tmp_path, 4, transport, schema=schema_file(tmp_path), guided=False, repair_attempts=2
    )
    result = rows(ledger)
    assert [r["status"] for r in result] == ["invalid"] * 4
    assert all(r["output"].endswith(",") and r["error"] for r in result)
    assert [r["repairs"] for r in result] == [2] * 4
    assert len(transport.bodies) == 12  # the ask and two repairs each
    assert stats.repairs == 8


@pytest.mark.anyio
async def test_no_repairs_when_repair_attempts_is_zero(tmp_path: Path) -> None:
    transport = sim(json_styles={"violating": 1.0})
    ledger, stats, _ = await run(
        tmp_path, 3, transport, schema=schema_file(tmp_path), guided=False, repair_attempts=0
    )
    result = rows(ledger)
    assert [r["status"] for r in result] == ["invalid"] * 3
    assert all(r["error"].startswith("schema violation") for r in result)
    assert all(r["parsed"] is not None for r in result)  # what it did answer is kept
    assert len(transport.bodies) == 3 and stats.repairs == 0


@pytest.mark.anyio
async def test_a_server_refusing_response_format_gets_unguided_requests_said_once(
    tmp_path: Path,
) -> None:
    transport = sim(refuse_response_format=True, json_styles={"fenced": 0.5})
    ledger, stats, _ = await run(
        tmp_path, 10, transport, schema=schema_file(tmp_path), concurrency=1
    )
    result = rows(ledger)
    assert [r["status"] for r in result] == ["done"] * 10
    assert stats.guided_refused is not None and "response_format" in stats.guided_refused
    guided = [i for i, b in enumerate(transport.bodies) if "response_format" in b]
    # The first request found out; at most the next item's, sent while the first item was
    # asking again without the schema (a slot is held per request, not per item), asked too.
    assert guided[0] == 0 and len(guided) <= 2 and guided[-1] <= 2
    log = (tmp_path / "logs" / "j.log").read_text().splitlines()
    assert sum(json.loads(x)["event"] == "guided_refused" for x in log) == 1
    line = summary_line(report(ledger.counts("j"), stats))
    assert "refused response_format" in line


@pytest.mark.anyio
async def test_a_400_caused_by_the_prompt_fails_that_item_and_keeps_guidance_on(
    tmp_path: Path,
) -> None:
    class PoisonPrompt(Recording):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            body = json.loads(request.content or b"{}")
            if body.get("messages", [{}])[0].get("content") == "prompt number 2":
                self.bodies.append(body)
                return httpx.Response(400, json={"error": {"message": "context too long"}})
            return await super().handle_async_request(request)

    transport = PoisonPrompt(SimConfig(json_schema=SCHEMA))
    ledger, stats, _ = await run(
        tmp_path, 6, transport, schema=schema_file(tmp_path), concurrency=1
    )
    result = rows(ledger)
    assert [r["status"] for r in result] == ["done", "done", "failed", "done", "done", "done"]
    assert "context too long" in result[2]["error"]
    assert stats.guided_refused is None
    # Only item 2's own retry went without the schema; every other request kept it.
    unguided = [b["messages"][0]["content"] for b in transport.bodies if "response_format" not in b]
    assert unguided == ["prompt number 2"] and len(transport.bodies) == 7


@pytest.mark.anyio
async def test_truncated_answers_are_invalid_with_a_schema_and_done_without(
    tmp_path: Path,
) -> None:
    ledger, _stats, _ = await run(
        tmp_path / "a", 4, sim(), schema=schema_file(tmp_path), max_tokens=3
    )
    result = rows(ledger)
    assert [r["status"] for r in result] == ["invalid"] * 4
    assert all(
        r["finish_reason"] == "length" and r["error"].startswith("truncated") for r in result
    )
    ledger, _stats, _ = await run(tmp_path / "b", 4, sim(), max_tokens=3)
    result = rows(ledger)
    assert [r["status"] for r in result] == ["done"] * 4
    assert all(r["finish_reason"] == "length" for r in result)


@pytest.mark.anyio
async def test_retry_longer_doubles_max_tokens_until_the_answer_fits(tmp_path: Path) -> None:
    transport = sim()
    ledger, stats, _ = await run(
        tmp_path,
        3,
        transport,
        schema=schema_file(tmp_path),
        max_tokens=2,
        on_truncate="retry-longer",
        max_tokens_cap=4096,
    )
    result = rows(ledger)
    assert [r["status"] for r in result] == ["done"] * 3
    assert all(r["finish_reason"] == "stop" for r in result)
    asked = sorted({b["max_tokens"] for b in transport.bodies})
    assert asked[:3] == [2, 4, 8] and all(b == a * 2 for a, b in itertools.pairwise(asked))
    assert stats.retries == 0


@pytest.mark.anyio
async def test_retry_longer_stops_at_the_cap(tmp_path: Path) -> None:
    transport = sim()
    ledger, _stats, _ = await run(
        tmp_path,
        2,
        transport,
        schema=schema_file(tmp_path),
        max_tokens=2,
        on_truncate="retry-longer",
        max_tokens_cap=5,
    )
    result = rows(ledger)
    assert [r["status"] for r in result] == ["invalid"] * 2
    assert all(r["error"].startswith("truncated") for r in result)
    assert sorted({b["max_tokens"] for b in transport.bodies}) == [2, 4, 5]


@pytest.mark.anyio
async def test_status_shows_invalid_counts_and_commonest_errors_and_retry_requeues_them(
    tmp_path: Path,
) -> None:
    transport = sim(json_styles={"violating": 0.5})
    ledger, _stats, _ = await run(
        tmp_path, 20, transport, schema=schema_file(tmp_path), guided=False, repair_attempts=0
    )
    counts = ledger.counts("j")
    assert counts["invalid"] > 0 and counts["done"] > 0
    job = ledger.get_job("j")
    assert job is not None
    detail = job_detail(ledger, job)
    # every violating answer breaks the first property the same way: one error line
    (top,) = detail["top_invalid"]
    assert top["count"] == counts["invalid"] and top["error"].startswith("schema violation at")
    text = render_detail(detail)
    assert f"{counts['invalid']} invalid" in text and "invalid    " in text
    # export: parsed JSON for done items
    home = Home.at(tmp_path, None)
    jobs.export(ledger, home.output_path("j"), "j", jobs.job_spec(job))
    lines = [orjson.loads(x) for x in home.output_path("j").read_bytes().splitlines()]
    assert all(valid(r["parsed"]) for r in lines if r["status"] == "done")
    assert ledger.requeue("j") == counts["invalid"]
    assert ledger.counts("j")["pending"] == counts["invalid"]


# --- per-line schemas -----------------------------------------------------------------------


def _job_from_lines(tmp_path: Path, lines: list[dict[str, Any]], **options: Any) -> Ledger:
    from batchrun.config import resolve

    (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    ledger = Ledger(Home.at(tmp_path, None).ledger_url)
    # no /metrics watch: under a fake clock its polling never rests, and starves the run
    spec = resolve({"backend": "sim", "server_metrics": "off", **options})
    jobs.create_job(ledger, "j", tmp_path / "in.jsonl", spec)
    return ledger


def test_a_line_with_an_unusable_schema_is_refused_by_line_number(tmp_path: Path) -> None:
    lines = [
        {"prompt": "fine", "schema": SCHEMA},
        {"prompt": "bad", "schema": {"type": "nonsense"}},
        {"prompt": "both", "schema": SCHEMA, "response_format": {"type": "json_object"}},
    ]
    with pytest.raises(InputError) as err:
        _job_from_lines(tmp_path, lines)
    problems = dict(err.value.problems)
    assert set(problems) == {2, 3}
    assert "not a valid JSON Schema" in problems[2]
    assert "both 'schema' and 'response_format'" in problems[3]


@pytest.mark.anyio
async def test_each_line_is_validated_against_its_own_schema(tmp_path: Path) -> None:
    other = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    lines = [
        {"id": "a", "prompt": "p1", "schema": SCHEMA},
        {"id": "b", "prompt": "p2", "schema": other},
        {"id": "c", "prompt": "p3"},
    ]
    ledger = _job_from_lines(tmp_path, lines)
    transport = sim()
    job = ledger.get_job("j")
    assert job is not None
    from batchrun.run_state import RunnerSettings

    fake = FakeTime()
    await jobs.run_job(
        ledger,
        Home.at(tmp_path, None),
        "j",
        jobs.job_spec(job),
        transport=transport,
        settings=RunnerSettings(sleep=fake.sleep, clock=fake.clock),
        handle_signals=False,
    )
    result = {r["item_id"]: r for r in rows(ledger)}
    assert result["a"]["status"] == "done" and valid(json.loads(result["a"]["parsed"]))
    assert result["b"]["status"] == "done" and "city" in json.loads(result["b"]["parsed"])
    assert result["c"]["status"] == "done" and result["c"]["parsed"] is None
    sent = {b["messages"][0]["content"]: b.get("response_format") for b in transport.bodies}
    assert sent["p2"]["json_schema"]["schema"] == other and sent["p3"] is None


# --- follow-ups that cannot help or that fail ------------------------------------------------


def _completion(text: str, finish: str, prompt: int | None, used: int | None) -> Completion:
    return Completion(text, finish, prompt, used, 0.1, None)


def test_retry_longer_stops_when_the_context_not_max_tokens_cut_the_answer() -> None:
    rules = OutputRules(schema=SCHEMA, guided_style=None, retry_longer=True)
    plan = rules.plan("chat", {"messages": [{"role": "user", "content": "x"}]})
    # no max_tokens set and nothing generated: the prompt filled the context
    outcome = plan.judge(_completion("", "length", 500, 0))
    assert outcome is not None and outcome.status == "invalid"
    plan = rules.plan("chat", {"messages": [], "max_tokens": 100})
    # 40 of 100 tokens and cut: more max_tokens cannot help
    outcome = plan.judge(_completion('{"name": "ab"', "length", 10, 40))
    assert outcome is not None and outcome.error is not None
    assert outcome.error.startswith("truncated") and plan.longer == 0


def test_every_longer_attempt_counts_in_the_items_usage() -> None:
    rules = OutputRules(schema=None, guided_style=None, retry_longer=True)
    plan = rules.plan("chat", {"messages": [], "max_tokens": 100})
    assert plan.judge(_completion("x" * 10, "length", 20, 100)) is None
    assert plan.request()["max_tokens"] == 200
    outcome = plan.judge(_completion("x" * 15, "stop", 20, 150))
    assert outcome == Outcome("done", None, None)
    assert plan.usage == (40, 250)


@pytest.mark.anyio
async def test_a_failed_follow_up_keeps_the_answer_the_item_had(tmp_path: Path) -> None:
    class RepairsRefused(Recording):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            body = json.loads(request.content or b"{}")
            if len(body.get("messages", [])) > 1:  # the repair: too long for the context
                self.bodies.append(body)
                return httpx.Response(400, json={"error": {"message": "context too long"}})
            return await super().handle_async_request(request)

    transport = RepairsRefused(SimConfig(json_schema=SCHEMA, json_styles={"violating": 1.0}))
    ledger, stats, _ = await run(tmp_path, 3, transport, schema=schema_file(tmp_path), guided=False)
    result = rows(ledger)
    assert [r["status"] for r in result] == ["invalid"] * 3
    assert all(r["output"] and r["parsed"] is not None for r in result)
    assert all(
        r["error"].startswith("schema violation") and "context too long" in r["error"]
        for r in result
    )
    assert [r["repairs"] for r in result] == [1, 1, 1]
    assert stats.guided_refused is None


@pytest.mark.anyio
async def test_one_lines_refused_schema_leaves_the_others_guided(tmp_path: Path) -> None:
    odd = {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}

    class GrammarRefusesOdd(Recording):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            body = json.loads(request.content or b"{}")
            fmt = body.get("response_format") or {}
            if fmt.get("json_schema", {}).get("schema") == odd:
                self.bodies.append(body)
                return httpx.Response(400, json={"error": {"message": "unsupported schema"}})
            return await super().handle_async_request(request)

    lines = [{"id": f"n{i}", "prompt": f"normal {i}"} for i in range(4)]
    lines.insert(1, {"id": "odd", "prompt": "odd one", "schema": odd})
    ledger = _job_from_lines(tmp_path, lines, schema=schema_file(tmp_path), concurrency=1)
    transport = GrammarRefusesOdd(SimConfig(json_schema=SCHEMA))
    job = ledger.get_job("j")
    assert job is not None
    from batchrun.run_state import RunnerSettings

    fake = FakeTime()
    stats = await jobs.run_job(
        ledger,
        Home.at(tmp_path, None),
        "j",
        jobs.job_spec(job),
        transport=transport,
        settings=RunnerSettings(sleep=fake.sleep, clock=fake.clock),
        handle_signals=False,
    )
    result = {r["item_id"]: r for r in rows(ledger)}
    # unguided, the simulated model answers with the job's schema, not the odd one
    assert result["odd"]["status"] == "invalid" and "'x'" in result["odd"]["error"]
    assert all(result[f"n{i}"]["status"] == "done" for i in range(4))
    assert stats.guided_refused is not None and "unsupported schema" in stats.guided_refused
    later = [b for b in transport.bodies if b["messages"][0]["content"].startswith("normal")]
    assert later and all("response_format" in b for b in later)


def test_a_schema_field_that_is_not_an_object_stays_meta(tmp_path: Path) -> None:
    ledger = _job_from_lines(tmp_path, [{"prompt": "p", "schema": "v2"}])
    (row,) = rows(ledger)
    assert json.loads(row["meta"]) == {"schema": "v2"}
    assert "response_format" not in json.loads(row["body"])
