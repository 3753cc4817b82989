"""The simulator's prefix cache: the block cache alone, then its effect on SimModel's replies."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from click.testing import CliRunner

from batchrun import cli_sim
from batchrun.backends.build import sim_config
from batchrun.config import resolve
from batchrun.errors import UsageError
from batchrun.server_metrics import ServerLoad, parse_metrics
from batchrun.sim import SimConfig, SimModel, prompt_text
from batchrun.sim.model import WORDS
from batchrun.sim.prefix_cache import BLOCK_CHARS, PrefixCache, words_within
from tests.fakes import served_by_sim_cli
from tests.unit.test_sim import CHAT, COMPLETIONS, json_of, post, sse_data

# --- the block cache --------------------------------------------------------------------------


def small(capacity: int) -> PrefixCache:
    """Blocks of 4 characters, so a test's prompts can be read block by block."""
    return PrefixCache(capacity_blocks=capacity, block_chars=4)


def test_lookup_finds_the_longest_cached_run_of_leading_blocks() -> None:
    cache = small(100)
    assert cache.lookup_and_insert("aaaabbbbcccc") == 0
    assert cache.lookup("aaaabbbbcccc") == 12
    assert cache.lookup("aaaabbbbxxxx") == 8
    assert cache.lookup("aaaabbbbcc") == 8  # its last block is not full
    assert cache.lookup("aaaaxxxxcccc") == 4  # the run stops at the first miss
    assert cache.lookup("zzzz") == 0
    assert cache.lookup_and_insert("aaaabbbbxxxx") == 8
    assert cache.lookup("aaaabbbbxxxx") == 12


def test_only_full_blocks_are_cached() -> None:
    cache = small(100)
    cache.insert("aaaabb")
    assert len(cache) == 1
    assert cache.lookup("aaaabb") == 4


def test_a_block_matches_only_after_the_same_blocks() -> None:
    cache = small(100)
    cache.insert("xxxxbbbb")
    assert cache.lookup("yyyybbbb") == 0  # same second block, different first one
    assert cache.lookup("bbbb") == 0  # the same text at another place is another block
    assert cache.lookup("xxxxbbbb") == 8


def test_the_least_recently_used_block_goes_at_capacity() -> None:
    cache = small(2)
    cache.insert("aaaa")
    cache.insert("bbbb")
    cache.insert("aaaa")  # refreshed: now "bbbb" is the oldest
    cache.insert("cccc")
    assert len(cache) == 2
    assert cache.lookup("bbbb") == 0
    assert cache.lookup("aaaa") == 4 and cache.lookup("cccc") == 4


def test_a_lookup_alone_refreshes_nothing() -> None:
    cache = small(2)
    cache.insert("aaaa")
    cache.insert("bbbb")
    assert cache.lookup("aaaa") == 4
    cache.insert("cccc")
    assert cache.lookup("aaaa") == 0
    assert cache.lookup("bbbb") == 4


def test_a_prompt_keeps_its_head_and_loses_its_tail_first() -> None:
    cache = small(2)
    cache.insert("aaaabbbbcccc")  # longer than the cache: its head stays
    assert len(cache) == 2
    assert cache.lookup("aaaabbbbcccc") == 8
    cache.insert("dddd")  # evicts the prompt's tail block, not its head
    assert cache.lookup("aaaabbbb") == 4


@pytest.mark.parametrize("capacity", [0, -3])
def test_no_capacity_turns_the_cache_off(capacity: int) -> None:
    cache = small(capacity)
    assert cache.lookup_and_insert("aaaabbbb") == 0
    assert cache.lookup_and_insert("aaaabbbb") == 0
    assert len(cache) == 0


def test_words_within_counts_only_whole_words() -> None:
    text = "alpha bravo charlie"
    assert words_within(text, 0) == 0
    assert words_within(text, 5) == 1  # "alpha", ended by the space after it
    assert words_within(text, 8) == 1  # "bravo" is cut
    assert words_within(text, 12) == 2
    assert words_within(text, len(text)) == 3
    assert words_within(text, 100) == 3


# --- in SimModel ------------------------------------------------------------------------------

SHARED = " ".join(WORDS[i % len(WORDS)] for i in range(1000))  # a 1,000-token system prompt
OTHER = " ".join(WORDS[(i + 7) % len(WORDS)] for i in range(1000))


def ask(system: str, question: str, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return {"model": "sim-1", "messages": messages, **extra}


def first_token_delay(reply: Any) -> float:
    """Seconds before the first token: the first content chunk's delay when streamed."""
    assert reply.status == 200 and reply.events is not None
    for (delay, _raw), payload in zip(reply.events, sse_data(reply.events), strict=True):
        if payload != "[DONE]" and orjson.loads(payload)["choices"][0]["delta"].get("content"):
            return delay
    raise AssertionError("no token in the reply")


def prompt_tokens(body: dict[str, Any]) -> int:
    return len(prompt_text("chat", body).split())


def prefilling(**extra: Any) -> SimModel:
    """10 ms to first token plus 1 ms per prompt token read, no decode time; the clock stands
    still, so requests stay in their slots and only the plan is tested."""
    config = SimConfig(ttft_ms=10.0, prefill_ms_per_token=1.0, **extra)
    return SimModel(config, clock=lambda: 0.0)


def cache_stats(model: SimModel) -> dict[str, int]:
    stats = json_of(model.handle("GET", "/sim/stats", {}, b""))["prefix_cache"]
    assert isinstance(stats, dict)
    return stats


def test_a_shared_prefix_shortens_the_first_token_delay() -> None:
    model = prefilling()
    first_body = ask(SHARED, "What is the first word?", stream=True)
    second_body = ask(SHARED, "And what is the last one?", stream=True)
    first = first_token_delay(post(model, CHAT, first_body))
    second = first_token_delay(post(model, CHAT, second_body))
    assert first == pytest.approx((10 + prompt_tokens(first_body)) / 1000)
    cached = cache_stats(model)["cached_tokens"]
    assert 950 <= cached < 1000  # all but the block where the question starts
    assert second == pytest.approx((10 + prompt_tokens(second_body) - cached) / 1000)
    assert second < first - 0.9


def test_a_non_streamed_reply_waits_less_too() -> None:
    model = prefilling()
    first = post(model, CHAT, ask(SHARED, "one?"))
    second = post(model, CHAT, ask(SHARED, "two?"))
    assert json_of(first)["usage"]["prompt_tokens"] == json_of(second)["usage"]["prompt_tokens"]
    assert second.delay < first.delay - 0.9


def test_a_different_prefix_gets_no_discount() -> None:
    model = prefilling()
    post(model, CHAT, ask(SHARED, "first?", stream=True))
    body = ask(OTHER, "first?", stream=True)
    delay = first_token_delay(post(model, CHAT, body))
    assert delay == pytest.approx((10 + prompt_tokens(body)) / 1000)
    assert cache_stats(model)["hits"] == 0


def test_the_same_prompt_again_still_reads_its_last_token() -> None:
    model = prefilling()
    body = {"model": "sim-1", "prompt": "abc " * BLOCK_CHARS}  # whole blocks, nothing left over
    first, again = post(model, COMPLETIONS, body), post(model, COMPLETIONS, body)
    assert first.delay == pytest.approx((10 + BLOCK_CHARS) / 1000)
    assert again.delay == pytest.approx((10 + 1) / 1000)
    assert cache_stats(model)["cached_tokens"] == BLOCK_CHARS - 1


def test_stats_and_metrics_count_queried_and_cached_tokens() -> None:
    model = prefilling(slots=4)
    bodies = [ask(SHARED, "one?"), ask(SHARED, "two?"), ask(OTHER, "three?")]
    for body in bodies:
        post(model, CHAT, body)
    stats = cache_stats(model)
    queried = sum(prompt_tokens(body) for body in bodies)
    assert stats == {
        "queries": 3,
        "hits": 1,
        "prompt_tokens": queried,
        "cached_tokens": stats["cached_tokens"],
    }
    assert 950 <= stats["cached_tokens"] < 1000
    assert model.stats()["prefix_cache"] == stats
    page = model.handle("GET", "/metrics", {}, b"").body.decode()
    labels = '{engine="0",model_name="sim-1"}'
    assert page.splitlines()[-6:] == [
        "# HELP vllm:prefix_cache_queries_total "
        "Prefix cache queries, in terms of number of queried tokens.",
        "# TYPE vllm:prefix_cache_queries_total counter",
        f"vllm:prefix_cache_queries_total{labels} {float(queried)}",
        "# HELP vllm:prefix_cache_hits_total "
        "Prefix cache hits, in terms of number of cached tokens.",
        "# TYPE vllm:prefix_cache_hits_total counter",
        f"vllm:prefix_cache_hits_total{labels} {float(stats['cached_tokens'])}",
    ]
    assert parse_metrics(page) == ServerLoad(3.0, 0.0, 0.75, "vllm")  # the load reads as before


def test_off_charges_every_token_and_counts_nothing() -> None:
    model = prefilling(prefix_cache_blocks=0)
    bodies = [ask(SHARED, "one?", stream=True), ask(SHARED, "two?", stream=True)]
    for body in bodies:
        delay = first_token_delay(post(model, CHAT, body))
        assert delay == pytest.approx((10 + prompt_tokens(body)) / 1000)
    assert "prefix_cache" not in model.stats()
    page = model.handle("GET", "/metrics", {}, b"").body.decode()
    assert 'vllm:prefix_cache_hits_total{engine="0",model_name="sim-1"} 0.0' in page


def test_stats_leave_the_cache_out_until_it_holds_a_block() -> None:
    model = prefilling()
    post(model, CHAT, ask("be brief", "hi"))  # shorter than a block: nothing to cache
    assert "prefix_cache" not in json_of(model.handle("GET", "/sim/stats", {}, b""))
    post(model, CHAT, ask(SHARED, "hi"))
    assert cache_stats(model) == {
        "queries": 2,
        "hits": 0,
        "prompt_tokens": prompt_tokens(ask("be brief", "hi")) + prompt_tokens(ask(SHARED, "hi")),
        "cached_tokens": 0,
    }


def test_a_refused_request_caches_nothing() -> None:
    model = prefilling(slots=1, queue_limit=0)
    assert post(model, CHAT, ask(SHARED, "taken?")).status == 200
    refused = ask(OTHER, "refused?")
    assert post(model, CHAT, refused).status == 429  # the one slot is busy, no queue
    assert model.prefix_cache.cache.lookup(prompt_text("chat", refused)) == 0
    assert cache_stats(model)["queries"] == 1


def test_a_slot_is_held_only_for_the_uncached_prefill() -> None:
    """With one slot, a queued request waits for the ones before it: their first-token times,
    each shortened by the cache, so the queue drains faster too."""
    model = prefilling(slots=1)
    bodies = [ask(SHARED, f"question {n}?", stream=True, max_tokens=1) for n in range(3)]
    delays = [first_token_delay(post(model, CHAT, body)) for body in bodies]
    full = (10 + prompt_tokens(bodies[0])) / 1000
    cached_each = cache_stats(model)["cached_tokens"] // 2  # the two later ones hit alike
    short = (10 + prompt_tokens(bodies[1]) - cached_each) / 1000
    assert delays == [
        pytest.approx(full),
        pytest.approx(full + short),
        pytest.approx(full + 2 * short),
    ]


# --- setting the capacity ---------------------------------------------------------------------


def test_sim_options_set_the_capacity() -> None:
    spec = resolve({"backend": "sim", "sim_options": {"prefix_cache_blocks": 16}})
    assert sim_config(spec).prefix_cache_blocks == 16
    assert sim_config(resolve({"backend": "sim"})).prefix_cache_blocks == 4096
    with pytest.raises(UsageError, match="prefix_cache_blocks must be int"):
        sim_config(resolve({"backend": "sim", "sim_options": {"prefix_cache_blocks": "many"}}))


@pytest.mark.parametrize(("flags", "blocks"), [([], 4096), (["--prefix-cache-blocks", "0"], 0)])
def test_sim_cli_sets_the_capacity(
    monkeypatch: pytest.MonkeyPatch, flags: list[str], blocks: int
) -> None:
    served = served_by_sim_cli(monkeypatch, flags)
    assert served.config.prefix_cache_blocks == blocks
    refused = CliRunner().invoke(cli_sim.sim, ["--port", "0", "--prefix-cache-blocks", "-1"])
    assert refused.exit_code == 2
