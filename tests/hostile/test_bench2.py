"""A second hostile review of `batchrun bench`, this time against a server batchrun did not write:
llama.cpp's C++ `llama-server` with the tiny stories260K model, on 127.0.0.1.

The ground truth is the server's own account of each request: llama-server puts `timings`
(prompt_n, cache_n, prompt_ms, predicted_n, predicted_ms, predicted_per_token_ms) on the last
chunk of every streamed answer, next to `usage`. The tests tap the bytes bench's own client
reads (its StreamedAnswer is fed them unchanged) and pair each request bench recorded with the
server's timings for it, so bench's figures are compared with the server's figures for the very
same requests. No test asserts on an absolute duration; tolerances are wide (a factor of 2).

The binary and the model are found as tests/integration's llama-server tests find them (a skip
saying why where either is missing; a failure under BATCHRUN_REQUIRE_LLAMA_SERVER=1, as in CI).
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import orjson
import pytest

from batchrun.backends import answers
from batchrun.bench import load
from batchrun.bench.load import LoadPlan
from batchrun.bench.run import Endpoint, run_bench
from batchrun.bench.suite import BenchClass, Suite, builtin_suite, select
from batchrun.config import resolve
from tests.integration.llama_server import NativeLlamaServer, require_llama_server

# --- the server -----------------------------------------------------------------------------


@pytest.fixture
def server(tmp_path: Path) -> Iterator[NativeLlamaServer]:
    """A fresh server per test, 2 slots: its prompt cache starts empty."""
    binary = require_llama_server()
    s = NativeLlamaServer(binary, tmp_path / "llama-server.log", metrics=False, slots=2)
    s.start()
    try:
        yield s
    finally:
        s.kill()


# --- the server's own timings for each request bench recorded -------------------------------


@pytest.fixture
def tapped(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, dict[str, Any] | None]]:
    """(bench's RequestRecord, llama-server's `timings` for that request), for every request
    bench sent, in the order bench recorded them (each level's warm-ups first)."""
    raw: dict[int, list[bytes]] = {}
    timings_of: dict[int, dict[str, Any] | None] = {}
    pairs: list[tuple[Any, dict[str, Any] | None]] = []
    feed, completion, record_of = (
        answers.StreamedAnswer.feed,
        answers.StreamedAnswer.completion,
        load.record_of,
    )

    def tee(self: Any, chunk: bytes) -> None:
        raw.setdefault(id(self), []).append(bytes(chunk))
        feed(self, chunk)

    def completed(self: Any) -> Any:
        c = completion(self)
        found = None
        for line in b"".join(raw.pop(id(self), [])).split(b"\n"):
            if line.startswith(b"data: {") and b'"timings"' in line:
                found = orjson.loads(line[6:]).get("timings")
        timings_of[id(c)] = found
        return c

    def recorded(*args: Any, **kwargs: Any) -> Any:
        record = record_of(*args, **kwargs)
        result = args[4] if len(args) > 4 else kwargs["result"]
        pairs.append((record, timings_of.pop(id(result), None)))
        return record

    monkeypatch.setattr(answers.StreamedAnswer, "feed", tee)
    monkeypatch.setattr(answers.StreamedAnswer, "completion", completed)
    monkeypatch.setattr(load, "record_of", recorded)
    return pairs


def _bench(
    server: NativeLlamaServer, suite: Suite, levels: tuple[int, ...], repeat: int, out: Path
) -> Any:
    spec = resolve({"backend": "llamacpp", "base_url": server.url, "timeout": 120.0})
    plan = LoadPlan(levels=levels, repeat=repeat, warmup=2)

    async def go() -> Any:
        return await run_bench(
            [Endpoint("llama", spec)],
            suite,
            plan,
            out,
            label="review",
            selftest=False,
            say=lambda _s: None,
            show=lambda _s: None,
        )

    return anyio.run(go)


def _cell(results: dict[str, Any], cls: str, level: int) -> dict[str, Any]:
    return next(c for c in results["cells"] if c["class"] == cls and c["concurrency"] == level)


# --- the defects ----------------------------------------------------------------------------


def test_tpot_divides_by_tokens_the_server_decoded_before_the_first_content_chunk(
    server: NativeLlamaServer, tapped: list[tuple[Any, dict[str, Any] | None]], tmp_path: Path
) -> None:
    """The built-in `json` class, guided (`response_format` json_object with the schema, as
    the llamacpp preset sends it), `--max-tokens 32`. Under the JSON grammar the tiny model
    first decodes ~24 whitespace tokens that llama-server counts (usage.completion_tokens = 32
    = timings.predicted_n) but never streams as content: the answer's first content delta
    comes 24 tokens into decoding, and only 8 content deltas come at all. Bench takes TTFT at
    that first content delta, then divides the time after it, which holds ~8 tokens, by
    usage's 32 - 1 = 31 tokens. Observed: bench TPOT p50 0.19 ms; the server's own
    predicted_per_token_ms for the same requests 0.72 ms (3.8x more); bench's own ITL p50, 0.85
    ms, says so too. The same happens, smaller, at the class's own max_tokens 128 (~26 of
    ~90 tokens unseen: TPOT about 0.75x the server's). A user comparing engines by TPOT would
    rank a JSON-constrained engine 4x faster per token than it is."""
    suite = select(builtin_suite(), ["json"], 32)
    results = _bench(server, suite, (1,), 10, tmp_path / "out")
    cell = _cell(results, "json", 1)
    assert cell["success_rate"] == 1.0, cell["errors"]
    server_per_token = [t["predicted_per_token_ms"] for r, t in tapped if t and r.ok]
    assert len(server_per_token) >= 10, "the server's timings were not seen"
    truth = statistics.median(server_per_token)
    bench_tpot = cell["tpot_ms"]["p50"]
    assert bench_tpot is not None
    assert bench_tpot >= truth / 2, (
        f"bench says TPOT p50 {bench_tpot:.2f} ms; llama-server's own timings for the same "
        f"requests say {truth:.2f} ms per output token (bench ITL p50 "
        f"{cell['itl_ms']['p50']:.2f} ms); usage counted "
        f"{[r.output_tokens for r, _ in tapped][:5]} tokens, content deltas "
        f"{[r.chunks for r, _ in tapped][:5]}"
    )


def _long_prompts(count: int) -> tuple[str, ...]:
    """`count` distinct prompts of ~950 tokens of the stories model (under a slot's 2,048)."""
    words = ("the", "cat", "sat", "on", "a", "mat", "and", "then", "ran", "to", "big", "red")
    out = []
    for k in range(count):
        rng = random.Random(k)
        out.append(f"Story {k}: " + " ".join(rng.choice(words) for _ in range(600)))
    return tuple(out)


def test_every_level_after_the_first_measures_prompts_the_server_has_cached(
    server: NativeLlamaServer, tapped: list[tuple[Any, dict[str, Any] | None]], tmp_path: Path
) -> None:
    """A suite of 12 distinct ~950-token prompts (the shape of the built-in `summary` class,
    shortened to fit the tiny model's 2,048-token context), 8 output tokens, levels 1,2,
    `--repeat 4`. Bench sends the same prompts, by the same indexes, at every level (warm-up
    0-1, measured 2-5 at level 1 and again 2-5 at level 2), so from the second level on
    llama-server answers every measured request from its prompt cache: its timings say
    prompt_n = 1 and cache_n = ~950 for each, i.e. no prefill at all. Observed: bench's TTFT
    p50 is 109-170 ms at level 1 and 11-21 ms at level 2 (8-10x lower at twice the load;
    the server's prompt_ms 130-220 ms vs 4-18 ms with ~1,100-token prompts).
    Bench's TTFT-vs-concurrency table and the knee built on it compare cold prefill at level 1
    with no prefill at every
    higher level: a user reads that prefill gets cheaper with load and picks a higher
    concurrency on that evidence. (The built-in `short` class even repeats prompts inside one
    level: 16 prompts drawn from 10 topics.)"""
    suite = Suite([BenchClass("long", 8, _long_prompts(12))])
    results = _bench(server, suite, (1, 2), 4, tmp_path / "out")
    level2 = [(r, t) for r, t in tapped if r.concurrency == 2 and r.ok and t]
    # bench's records at level 2: its warm-ups come first (2 of them), then the measured ones
    measured = level2[2:]
    assert len(measured) >= 4, f"too few answers at level 2: {_cell(results, 'long', 2)['errors']}"
    cached = [t for r, t in measured if t["prompt_n"] < (r.prompt_tokens or 0) / 2]
    ttft1 = _cell(results, "long", 1)["ttft_ms"]["p50"]
    ttft2 = _cell(results, "long", 2)["ttft_ms"]["p50"]
    assert not cached, (
        f"{len(cached)} of {len(measured)} measured requests at level 2 were prefilled from "
        f"llama-server's prompt cache (prompt_n/cache_n: "
        f"{[(t['prompt_n'], t.get('cache_n')) for _, t in measured]}); bench's TTFT p50 is "
        f"{ttft1:.0f} ms at level 1 and {ttft2:.0f} ms at level 2"
    )


def test_the_knee_blames_load_for_failures_of_prompts_only_the_higher_level_sent(
    server: NativeLlamaServer, tapped: list[tuple[Any, dict[str, Any] | None]], tmp_path: Path
) -> None:
    """A user suite of 16 prompts of one class, the last four too long for a slot's context
    (llama-server answers them 400 "exceeds the available context size" at any load). Levels
    1,4, `--repeat 10`: level 1 measures prompts 2-11, level 4 rounds up to 12 requests and
    measures prompts 2-13, so only level 4 sends two of the over-long prompts. Its success rate
    is 83% against level 1's 100%, and the knee recommends 1 "(1 -> 4: success rate 100% ->
    83%)": load blamed for failures that a single request of those prompts gets too (checked
    here with a plain request at concurrency 1). Each level measures a different set of
    requests, so its success rate, and its tokens per request, are not comparable with the
    other levels', yet the knee compares them as if only the load had changed."""
    short = [p for c in builtin_suite().classes if c.name == "short" for p in c.prompts][:12]
    too_long = [" ".join([p] * 3) for p in _long_prompts(4)]
    suite = Suite([BenchClass("mixed", 16, tuple(short + too_long))])
    # a plain request of an over-long prompt, alone: refused whatever the load
    alone = httpx.post(
        server.url + "/chat/completions",
        json={"messages": [{"role": "user", "content": too_long[0]}], "max_tokens": 16},
        timeout=60,
    )
    assert alone.status_code == 400, alone.text
    results = _bench(server, suite, (1, 4), 10, tmp_path / "out")
    knee = next(k for k in results["knees"] if k["class"] == "mixed")
    rates = {c["concurrency"]: c["success_rate"] for c in results["cells"]}
    errors = {c["concurrency"]: c["errors"] for c in results["cells"]}
    assert "success rate" not in knee["reason"], (
        f"knee {knee['concurrency']}: {knee['reason']}; success rates {rates}, errors "
        f"{errors}: every failure is a 400 a lone request of that prompt gets too"
    )
