"""Hostile review of structured outputs (`--schema`): extraction, validation, repair,
truncation, and what a user sees of them. Each test fails on the code as reviewed.

Answers are scripted exactly (a plain JSON body per request, see `answering`), so every test
is about one answer text a model could plausibly write.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

import batchrun
from batchrun.errors import InputError, UsageError
from tests.unit.test_runner import ScriptedTransport, rows, run

PRICE: dict[str, Any] = {
    "type": "object",
    "properties": {"price": {"type": "number"}, "name": {"type": "string"}},
    "required": ["price"],
}


def schema_file(tmp_path: Path, schema: dict[str, Any]) -> str:
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    return str(path)


def body(text: str, finish: str = "stop") -> dict[str, Any]:
    return {
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": finish,
            }
        ],
        "usage": {"prompt_tokens": 5, "completion_tokens": 7},
    }


def answering(text: str) -> ScriptedTransport:
    """Every request is answered with `text` (not streamed: one JSON body)."""

    def handler(_request: httpx.Request, _call: int) -> httpx.Response:
        return httpx.Response(200, json=body(text))

    return ScriptedTransport(handler)


def validates(schema: dict[str, Any], value: Any) -> bool:
    return not list(jsonschema.Draft202012Validator(schema).iter_errors(value))


async def run_answering(
    tmp_path: Path, text: str, schema: dict[str, Any] = PRICE, n: int = 3, **options: Any
) -> list[dict[str, Any]]:
    options = {"guided": False, "repair_attempts": 0, **options}
    ledger, _stats, _ = await run(
        tmp_path, n, answering(text), schema=schema_file(tmp_path, schema), **options
    )
    return rows(ledger)


# --- 1. `done` answers whose `parsed` does not validate -------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize(
    "text",
    [
        '{"price": NaN}',
        'The price: {"price": NaN}',
        'Here you go: {"price": Infinity}',
        '{"price": 1e400}',  # Infinity by another name (from the review of the fix)
        'Total: {"price": -1E999}',
    ],
)
async def test_nan_or_infinity_is_not_json_and_never_makes_a_done_item(
    tmp_path: Path, text: str
) -> None:
    # NaN/Infinity are not JSON. The prose scan (json.JSONDecoder) takes them as floats, the
    # schema's "number" accepts a float nan, and orjson writes it back as null: the item is
    # `done` with parsed {"price": null}, which breaks the very schema it "passed".
    result = await run_answering(tmp_path, text)
    for r in result:
        if r["status"] == "done":
            assert validates(PRICE, json.loads(r["parsed"])), r["parsed"]
    assert [r["status"] for r in result] == ["invalid"] * 3


# --- 2. one answer text crashes the whole run (and every resume) ----------------------------


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("an integer over 64 bits, in prose", 'Result: {"price": 123456789012345678901234567890}'),
        ("a lone surrogate escape", '{"price": 1, "name": "caf\\ud83d"}'),
        ("a lone surrogate escape, in prose", 'Sure: {"price": 1, "name": "\\udc00"}'),
        ("brackets nested past Python's recursion limit", "Levels: " + "[" * 3000),
    ],
)
async def test_an_odd_answer_is_judged_and_recorded_not_a_crash_of_the_run(
    tmp_path: Path, name: str, text: str
) -> None:
    # Before: the answer's JSON is found by json.JSONDecoder, then orjson.dumps refuses to
    # write it back (TypeError), or the decoder itself raises RecursionError. Neither is
    # caught: the run dies with a traceback, the answers in flight are dropped (paid again),
    # and the item goes back to pending, so every `resume` asks again and dies again.
    try:
        result = await run_answering(tmp_path, text)
    except BaseException as exc:
        pytest.fail(f"{name}: the run crashed: {exc!r}")
    assert all(r["status"] in ("done", "invalid") for r in result), [r["status"] for r in result]


@pytest.mark.anyio
async def test_a_big_integer_in_a_whole_json_answer_is_never_another_number_in_parsed(
    tmp_path: Path,
) -> None:
    # orjson.loads reads an integer over 64 bits as a float: `parsed` held
    # 1.2345678901234568e+29, another number than the model wrote (the input side refuses
    # such ids for the same reason: "an integer too large to keep exactly"). The fix chosen:
    # such an answer is `invalid`, saying why, and its text is kept as written in `output`.
    schema = {"type": "object", "properties": {"code": {"type": "integer"}}, "required": ["code"]}
    text = '{"code": 123456789012345678901234567890}'
    result = await run_answering(tmp_path, text, schema)
    assert [r["status"] for r in result] == ["invalid"] * 3
    assert all("too large to keep exactly" in r["error"] for r in result), result[0]["error"]
    assert result[0]["output"] == text and result[0]["parsed"] is None
    (tmp_path / "fits").mkdir()
    fits = await run_answering(tmp_path / "fits", '{"code": 18446744073709551615}', schema)
    assert json.loads(fits[0]["parsed"]) == {"code": 18446744073709551615}  # 64 bits: kept


# --- 3. a schema jsonschema cannot use: accepted at submit, crash at the first answer -------


def test_a_schema_file_with_a_ref_to_nowhere_is_refused_before_anything_is_sent(
    tmp_path: Path,
) -> None:
    # check_schema() does not resolve $ref: '#/$defs/price' pointing nowhere passes load_schema,
    # the requests go out (and are paid for), and the first answer's validation raises
    # jsonschema's _WrappedReferencingError out of the run: a traceback, nothing recorded.
    schema = {
        "type": "object",
        "properties": {"price": {"$ref": "#/$defs/price"}},
        "required": ["price"],
    }
    path = schema_file(tmp_path, schema)
    rows_in = [{"id": f"r{i}", "prompt": f"price {i}"} for i in range(3)]
    try:
        batchrun.submit(rows_in, home=tmp_path / "home", backend="sim", schema=path)
    except UsageError as exc:  # what a bad schema file gets: exit 2, named, nothing sent
        assert "$defs/price" in str(exc)
    except BaseException as exc:
        pytest.fail(f"a crash instead of a usage error: {exc!r}")
    else:
        pytest.fail("the job ran with a schema that cannot validate anything")


def test_a_line_schema_with_a_ref_to_nowhere_is_a_bad_line(tmp_path: Path) -> None:
    from tests.unit.test_structured import _job_from_lines

    bad = {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}
    lines = [{"prompt": "fine"}, {"prompt": "bad ref", "schema": bad}]
    with pytest.raises(InputError) as err:
        _job_from_lines(tmp_path, lines)
    assert set(dict(err.value.problems)) == {2}


# --- 4. what `status` and a repair make of validation errors --------------------------------


CATEGORY: dict[str, Any] = {
    "type": "object",
    "properties": {"cat": {"enum": ["tools", "garden"]}},
    "required": ["cat"],
}


def by_prompt(answers: Callable[[str, int], str]) -> ScriptedTransport:
    """Answers chosen by the prompt (the last message) and the call number for it."""

    def handler(request: httpx.Request, call: int) -> httpx.Response:
        messages = json.loads(request.content)["messages"]
        return httpx.Response(200, json=body(answers(messages[0]["content"], call)))

    return ScriptedTransport(handler)


@pytest.mark.anyio
async def test_status_groups_invalid_answers_by_the_rule_they_break(tmp_path: Path) -> None:
    # Six answers break the same rule (an enum) with six different values. The error text
    # embeds the value jsonschema found ('toy-0' is not one of [...]), and `status` counts
    # errors by their exact text: six lines of "1 x", no commonest error at all.
    from batchrun.jobs import Home
    from batchrun.ledger import Ledger
    from batchrun.status_view import job_detail

    def answers(prompt: str, _call: int) -> str:
        return json.dumps({"cat": f"toy-{prompt.rsplit(' ', 1)[-1]}"})

    ledger, _stats, _ = await run(
        tmp_path,
        6,
        by_prompt(answers),
        schema=schema_file(tmp_path, CATEGORY),
        guided=False,
        repair_attempts=0,
    )
    assert [r["status"] for r in rows(ledger)] == ["invalid"] * 6
    ledger = Ledger(Home.at(tmp_path, None).ledger_url)
    job = ledger.get_job("j")
    assert job is not None
    top = job_detail(ledger, job)["top_invalid"]
    assert top and top[0]["count"] == 6, top


@pytest.mark.anyio
async def test_a_repair_prompt_does_not_carry_the_whole_answer_twice(tmp_path: Path) -> None:
    # An answer of the wrong type at the root: jsonschema's message is the repr of the whole
    # instance ("[{...}, ...] is not of type 'object'"), and the repair note embeds it after
    # the assistant turn that already holds the answer: the repair's prompt pays for the
    # answer twice (and may not fit the context), and `error` stores it again.
    big = json.dumps([{"sku": f"s{i}", "price": i} for i in range(400)])  # ~12 KB
    sent: list[dict[str, Any]] = []

    def handler(request: httpx.Request, _call: int) -> httpx.Response:
        sent.append(json.loads(request.content))
        first = len(sent[-1]["messages"]) == 1
        return httpx.Response(200, json=body(big if first else '{"price": 1}'))

    ledger, _stats, _ = await run(
        tmp_path, 1, ScriptedTransport(handler), schema=schema_file(tmp_path, PRICE), guided=False
    )
    (result,) = rows(ledger)
    assert result["status"] == "done" and result["repairs"] == 1
    repair = sent[1]["messages"]
    assert repair[1] == {"role": "assistant", "content": big}
    note = repair[2]["content"]
    assert len(note) < len(big) / 2, f"the repair note is {len(note)} characters"


# --- 5. an answer in hand when a follow-up stops the run ------------------------------------


@pytest.mark.anyio
async def test_an_answer_already_paid_for_is_not_asked_again_when_its_repair_stops_the_run(
    tmp_path: Path,
) -> None:
    # The item's answer came (and was paid for); its repair got a 401 (a key revoked
    # mid-run), which stops the job. The README: "If a follow-up itself fails ... or a budget
    # refuses to send it, the answer the item already had stands". Only the budget case is
    # handled: for any other fatal error the answer is dropped, the item goes back to pending,
    # and `resume` pays for the original request again.
    from batchrun import jobs
    from batchrun.config import resolve
    from batchrun.jobs import Home
    from batchrun.ledger import Ledger
    from batchrun.run_state import RunnerSettings
    from tests.fakes import FakeTime

    originals: list[str] = []
    key_ok = False

    def handler(request: httpx.Request, _call: int) -> httpx.Response:
        messages = json.loads(request.content)["messages"]
        if len(messages) == 1:
            originals.append(messages[0]["content"])
            return httpx.Response(200, json=body("Sorry, I cannot tell the price."))
        if not key_ok:
            return httpx.Response(401, json={"error": {"message": "key revoked"}})
        return httpx.Response(200, json=body('{"price": 2}'))

    ledger, stats, _ = await run(
        tmp_path, 1, ScriptedTransport(handler), schema=schema_file(tmp_path, PRICE), guided=False
    )
    assert stats.aborted is not None and "key revoked" in stats.aborted
    key_ok = True  # the key is fixed: resume
    home = Home.at(tmp_path, None)
    spec = resolve(
        {
            "backend": "sim",
            "concurrency": 4,
            "max_attempts": 3,
            "guided": False,
            "schema": schema_file(tmp_path, PRICE),
        }
    )
    fake = FakeTime()
    await jobs.run_job(
        Ledger(home.ledger_url),
        home,
        "j",
        spec,
        transport=ScriptedTransport(handler),
        settings=RunnerSettings(sleep=fake.sleep, clock=fake.clock, drain_timeout=0.0),
        handle_signals=False,
    )
    assert rows(ledger)[0]["status"] in ("done", "invalid")
    assert originals == ["prompt number 0"], f"the original request was sent {len(originals)} times"


# --- 6. the simulator's "constrained decoding" breaks common schemas -------------------------


# What pydantic's model_json_schema() writes for a model with a nested model: $defs and $ref.
PYDANTIC_STYLE: dict[str, Any] = {
    "$defs": {
        "Money": {
            "type": "object",
            "properties": {"amount": {"type": "number"}, "currency": {"type": "string"}},
            "required": ["amount", "currency"],
        }
    },
    "type": "object",
    "properties": {"name": {"type": "string"}, "price": {"$ref": "#/$defs/Money"}},
    "required": ["name", "price"],
}
# ISO codes: a two-letter country, a three-letter currency.
SHORT_CODES: dict[str, Any] = {
    "type": "object",
    "properties": {
        "country": {"type": "string", "minLength": 2, "maxLength": 2},
        "currency": {"type": "string", "pattern": "^[A-Z]{3}$"},
    },
    "required": ["country", "currency"],
}


@pytest.mark.anyio
@pytest.mark.parametrize("schema", [PYDANTIC_STYLE, SHORT_CODES], ids=["ref", "short-codes"])
async def test_the_simulator_answers_a_guided_request_with_json_valid_for_its_schema(
    tmp_path: Path, schema: dict[str, Any]
) -> None:
    # README: "A request that carries a schema in response_format always gets valid JSON for
    # it (what constrained decoding gives)". sim/json_answers.instance() ignores $ref (an empty
    # object for the Money), maxLength (five letters at least) and pattern: a user trying
    # their extraction job on `--backend sim` sees every line invalid, repairs and all.
    from batchrun.sim import SimModel, SimTransport

    ledger, _stats, _ = await run(
        tmp_path, 3, SimTransport(SimModel()), schema=schema_file(tmp_path, schema)
    )
    result = rows(ledger)
    assert [r["status"] for r in result] == ["done"] * 3, [r["error"] for r in result]


async def run_stopped_at_a_repair(
    tmp_path: Path, transport: Callable[[Callable[[], None]], Any], drain_timeout: float
) -> tuple[Any, dict[str, Any]]:
    """One line with a schema, run by a Runner whose transport (made by `transport`, given
    the run's stop: Ctrl-C) answers the first request with prose, so a repair follows; the
    run's stats and the line's stored row."""
    import dataclasses

    from batchrun import jobs
    from batchrun.backends.openai_compat import OpenAICompatBackend
    from batchrun.config import resolve
    from batchrun.jobs import Home
    from batchrun.lanes import Route
    from batchrun.ledger import Ledger
    from batchrun.progress import JobLog
    from batchrun.run_state import RunnerSettings
    from batchrun.runner import Runner
    from tests.unit.test_runner import write_prompts

    home = Home.at(tmp_path, None)
    ledger = Ledger(home.ledger_url)
    write_prompts(tmp_path / "in.jsonl", 1)
    options = {"backend": "sim", "concurrency": 1, "guided": False}
    spec = resolve({**options, "schema": schema_file(tmp_path, PRICE)})
    spec = dataclasses.replace(spec, model="sim-1")
    jobs.create_job(ledger, "j", tmp_path / "in.jsonl", spec)
    runners: list[Runner] = []
    backend = OpenAICompatBackend(
        spec.base_url, transport=transport(lambda: runners[0].request_stop())
    )
    log = JobLog(home.log_path("j"), "j")
    settings = RunnerSettings(drain_timeout=drain_timeout)
    rules = jobs.output_rules(spec)
    route = Route("sim", spec, backend)
    runners.append(Runner(ledger, [route], "j", spec, log=log, rules=rules, settings=settings))
    try:
        stats = await runners[0].run()
    finally:
        log.close()
        await backend.aclose()
    (result,) = rows(ledger)
    return stats, result


@pytest.mark.anyio
async def test_a_stop_before_a_repair_is_sent_keeps_the_answer_already_paid_for(
    tmp_path: Path,
) -> None:
    # Ctrl-C while an item's repair waited to be sent (here, to retry a 503): the request that
    # had waited past the stop is not sent, and the item went back to pending with its answer
    # (paid for) dropped: `resume` paid for the original request again. The answer stands now,
    # judged as it is, and its repair (never sent) is not counted.
    originals = 0

    def stopping(stop: Callable[[], None]) -> ScriptedTransport:
        def handler(request: httpx.Request, _call: int) -> httpx.Response:
            nonlocal originals
            if len(json.loads(request.content)["messages"]) == 1:
                originals += 1
                return httpx.Response(200, json=body("Sorry, I cannot tell the price."))
            stop()  # Ctrl-C while the repair waits to be sent again
            return httpx.Response(503, headers={"retry-after": "5"}, json={"error": "busy"})

        return ScriptedTransport(handler)

    stats, result = await run_stopped_at_a_repair(tmp_path, stopping, drain_timeout=30.0)
    assert stats.interrupted and originals == 1
    assert result["status"] == "invalid", result  # judged as it is: not pending, not lost
    assert "no JSON" in result["error"] and "stopped" in result["error"], result["error"]
    assert result["attempts"] == 2 and result["repairs"] == 1  # its 503 counts, not the unsent
