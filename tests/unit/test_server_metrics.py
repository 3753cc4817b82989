"""Server-aware mode's data side: Prometheus pages of vLLM, SGLang and llama.cpp, the /metrics
URL, the reader, and the simulator serving its real load under vLLM's names."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import anyio
import httpx
import pytest

from batchrun.backends.metrics_reader import MetricsReader
from batchrun.server_metrics import ServerLoad, metrics_url, parse_load, parse_metrics
from batchrun.sim import SimConfig, SimModel, SimServer, SimTransport
from tests.fakes import served_by_sim_cli
from tests.unit.test_capacity import Clock

URL = "http://sim.test/metrics"
Handler = (
    Callable[[httpx.Request], httpx.Response]
    | Callable[[httpx.Request], Coroutine[None, None, httpx.Response]]
)
KEY = "sk-metrics-secret"

# vLLM V1 with two data-parallel engines: one series per engine, summed; the KV cache usage is a
# fraction per engine, so the fullest one counts. Histograms and process metrics around it.
VLLM = """\
# HELP python_gc_objects_collected_total Objects collected during gc
# TYPE python_gc_objects_collected_total counter
python_gc_objects_collected_total{generation="0"} 12931.0
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3-0.6B"} 3.0
vllm:num_requests_running{engine="1",model_name="Qwen/Qwen3-0.6B"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen3-0.6B"} 1.0
vllm:num_requests_waiting{engine="1",model_name="Qwen/Qwen3-0.6B"} 0.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen3-0.6B"} 0.42
vllm:kv_cache_usage_perc{engine="1",model_name="Qwen/Qwen3-0.6B"} 0.17
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_sum{engine="0",model_name="Qwen/Qwen3-0.6B"} 2.35e+01
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="Qwen/Qwen3-0.6B"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="Qwen/Qwen3-0.6B"} 7.0
process_resident_memory_bytes 1.2345e+09
"""

# vLLM V0: one series per model name, the KV cache under its old name, a swapped gauge beside.
VLLM_V0 = """\
# HELP vllm:num_requests_running Number of requests currently running on GPU.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="meta-llama/Llama-3.1-8B-Instruct"} 8.0
# HELP vllm:num_requests_swapped Number of requests swapped to CPU.
# TYPE vllm:num_requests_swapped gauge
vllm:num_requests_swapped{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="meta-llama/Llama-3.1-8B-Instruct"} 5.0
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.93
"""

SGLANG = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{engine_type="unified",model_name="meta-llama/Llama-3.1-8B-Instruct",\
pp_rank="0",tp_rank="0"} 12.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{engine_type="unified",model_name="meta-llama/Llama-3.1-8B-Instruct",\
pp_rank="0",tp_rank="0"} 0.28
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{engine_type="unified",model_name="meta-llama/Llama-3.1-8B-Instruct",\
pp_rank="0",tp_rank="0"} 4.0
# HELP sglang:gen_throughput The generation throughput (token/s).
# TYPE sglang:gen_throughput gauge
sglang:gen_throughput{engine_type="unified",model_name="meta-llama/Llama-3.1-8B-Instruct",\
pp_rank="0",tp_rank="0"} 1523.7
"""

# llama-server --metrics: no labels, values printed by a C++ stream (no ".0"), no KV gauge.
LLAMACPP = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 5310
# HELP llamacpp:prompt_tokens_seconds Average prompt throughput in tokens/s
# TYPE llamacpp:prompt_tokens_seconds gauge
llamacpp:prompt_tokens_seconds 1234.56
# HELP llamacpp:requests_processing Number of requests processing
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 4
# HELP llamacpp:requests_deferred Number of requests deferred
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 9
# HELP llamacpp:n_busy_slots_per_decode Average number of busy slots per llama_decode() call
# TYPE llamacpp:n_busy_slots_per_decode gauge
llamacpp:n_busy_slots_per_decode 3.5
"""


# llama-server without --metrics: GET /slots (on by default). Captured from llama.cpp b1-0c1e570
# (`llama-server -np 4`) with two slots busy; a busy slot's fields trimmed to a few.
SLOTS = """[
 {"id": 0, "n_ctx": 1024, "speculative": false, "is_processing": true, "id_task": 41,
  "params": {"n_predict": 64, "temperature": 0.8}, "next_token": [{"n_decoded": 12}]},
 {"id": 1, "n_ctx": 1024, "speculative": false, "is_processing": false},
 {"id": 2, "n_ctx": 1024, "speculative": false, "is_processing": true, "id_task": 42},
 {"id": 3, "n_ctx": 1024, "speculative": false, "is_processing": false}
]"""
OLD_SLOTS = '[{"id": 0, "state": 1}, {"id": 1, "state": 0}, {"id": 2, "state": 1}]'


async def post_chat(client: httpx.AsyncClient, content: str) -> None:
    body = {"model": "sim-1", "messages": [{"role": "user", "content": content}]}
    response = await client.post("http://sim.test/v1/chat/completions", json=body)
    assert response.status_code == 200


# --- parsing --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (VLLM, ServerLoad(5.0, 1.0, 0.42, "vllm")),
        (VLLM_V0, ServerLoad(8.0, 5.0, 0.93, "vllm")),
        (SGLANG, ServerLoad(12.0, 4.0, 0.28, "sglang")),
        (LLAMACPP, ServerLoad(4.0, 9.0, None, "llamacpp")),
    ],
    ids=["vllm", "vllm-v0", "sglang", "llamacpp"],
)
def test_each_engines_page_gives_its_running_and_waiting(text: str, expected: ServerLoad) -> None:
    assert parse_metrics(text) == expected


@pytest.mark.parametrize(
    ("text", "running", "slots"), [(SLOTS, 2.0, 4), (OLD_SLOTS, 2.0, 3)], ids=["now", "older"]
)
def test_llama_servers_slots_say_how_many_run_of_how_many(
    text: str, running: float, slots: int
) -> None:
    assert parse_load(text) == ServerLoad(running, None, None, "llamacpp-slots", slots)


@pytest.mark.parametrize(
    "text",
    ["[]", "[1, 2]", '[{"id": 0}]', '[{"is_processing": "yes"}]', '[{"state": true}]', "[nope"],
)
def test_json_that_is_not_a_slots_page_gives_none(text: str) -> None:
    assert parse_load(text) is None


def test_a_slots_page_counts_ours_beyond_busy_slots_as_waiting() -> None:
    half = ServerLoad(2.0, None, None, "llamacpp-slots", 4)
    full = ServerLoad(4.0, None, None, "llamacpp-slots", 4)
    assert half.waiting_with(9) == 0.0  # a free slot: nothing waits
    assert full.waiting_with(9) == 5.0
    assert full.waiting_with(3) == 0.0  # another client's requests fill it
    assert ServerLoad(4.0, 2.0).waiting_with(9) == 2.0  # a server that counts them says


def test_a_prometheus_page_still_reads_as_one() -> None:
    assert parse_load(LLAMACPP) == parse_metrics(LLAMACPP)


def test_llamacpp_kv_usage_when_the_build_reports_it() -> None:
    text = (
        LLAMACPP + "# TYPE llamacpp:kv_cache_usage_ratio gauge\nllamacpp:kv_cache_usage_ratio 0.5\n"
    )
    assert parse_metrics(text) == ServerLoad(4.0, 9.0, 0.5, "llamacpp")


def test_vllm_prefers_the_current_kv_name_over_the_old_one() -> None:
    text = VLLM + 'vllm:gpu_cache_usage_perc{engine="0",model_name="Qwen/Qwen3-0.6B"} 0.99\n'
    load = parse_metrics(text)
    assert load is not None and load.kv_usage == 0.42


def test_labels_with_quotes_braces_and_commas_timestamps_and_exponents() -> None:
    text = (
        'vllm:num_requests_running{model_name="a \\"b\\" {c}, d",engine="0"} 3e+00\n'
        'vllm:num_requests_running{model_name="back\\\\slash\\n",} 1.5E1 1712345678000\n'
        "vllm:num_requests_running   2\n"
        '  vllm:num_requests_waiting {model_name="x"}  +4.0  \n'
    )
    assert parse_metrics(text) == ServerLoad(20.0, 4.0, None, "vllm")


def test_nan_and_broken_samples_are_skipped_not_summed() -> None:
    text = (
        'vllm:num_requests_running{engine="0"} NaN\n'
        'vllm:num_requests_running{engine="1"} 2\n'
        'vllm:num_requests_running{engine="2"} +Inf\n'
        'vllm:num_requests_running{engine="3",model_name="never closed} 7\n'
        "vllm:num_requests_running{} many\n"
        "vllm:num_requests_running\n"
        'vllm:num_requests_waiting{engine="0"} 1\n'
    )
    assert parse_metrics(text) == ServerLoad(2.0, 1.0, None, "vllm")


@pytest.mark.parametrize(
    "text",
    [
        "",
        "<html><body>404 page not found</body></html>",
        "# HELP process_cpu_seconds_total CPU time\nprocess_cpu_seconds_total 12.5\n",
        "vllm:num_requests_running 3\n",  # no waiting count: not enough to steer by
        "vllm:num_requests_running_total 3\nvllm:num_requests_waiting_total 1\n",
        "# vllm:num_requests_running 3\n# vllm:num_requests_waiting 1\n",
        "vllm:num_requests_running NaN\nvllm:num_requests_waiting 1\n",
        '{"running": 3, "waiting": 1}',
    ],
    ids=["empty", "html", "other-metrics", "half", "suffixed", "comments", "nan", "json"],
)
def test_pages_without_a_known_pair_give_none(text: str) -> None:
    assert parse_metrics(text) is None


@pytest.mark.parametrize(
    ("base", "expected"),
    [
        ("http://127.0.0.1:8000/v1", "http://127.0.0.1:8000/metrics"),
        ("http://127.0.0.1:8000/v1/", "http://127.0.0.1:8000/metrics"),
        ("http://localhost:8080", "http://localhost:8080/metrics"),
        ("http://localhost:8080/", "http://localhost:8080/metrics"),
        ("https://gw.example/llm/v1", "https://gw.example/llm/metrics"),
        ("https://gw.example/llm/v1?x=1#f", "https://gw.example/llm/metrics"),
        ("http://[::1]:30000/v1", "http://[::1]:30000/metrics"),
        ("http://h/v1beta", "http://h/v1beta/metrics"),  # only a whole /v1 segment is the API
    ],
)
def test_metrics_url_is_the_servers_root(base: str, expected: str) -> None:
    assert metrics_url(base) == expected


# --- the reader against the simulator ---------------------------------------------------------


class HeldSim:
    """A simulator on a test clock whose replies stay in flight until `load`'s block ends."""

    def __init__(self, config: SimConfig) -> None:
        self.clock = Clock()
        self.model = SimModel(config, clock=self.clock)
        self.transport = SimTransport(self.model, sleep=self._held)
        self._release = anyio.Event()

    async def _held(self, _seconds: float) -> None:
        await self._release.wait()

    @contextlib.asynccontextmanager
    async def load(self, n: int) -> AsyncIterator[None]:
        """`n` chat requests admitted (and so planned) at once, answered when the block ends."""
        async with (
            httpx.AsyncClient(transport=self.transport) as client,
            anyio.create_task_group() as tg,
        ):
            for i in range(n):
                tg.start_soon(post_chat, client, f"q{i}")
            while self.model.requests < n:
                await anyio.sleep(0)
            yield
            self._release.set()


FIXED = SimConfig(ttft_ms=100, tpot_ms=10, min_output_tokens=11, max_output_tokens=11)  # 0.2 s


@pytest.mark.anyio
async def test_reader_follows_the_sims_batch_and_queue() -> None:
    """5 requests of 0.2 s each against 2 slots: 2 decode, 3 wait; then the queue drains."""
    sim = HeldSim(dataclasses.replace(FIXED, slots=2))
    reader = MetricsReader(URL, transport=sim.transport)
    try:
        assert await reader.read() == ServerLoad(0.0, 0.0, 0.0, "vllm")
        with anyio.fail_after(10):
            async with sim.load(5):
                assert await reader.read() == ServerLoad(2.0, 3.0, 1.0, "vllm")
                sim.clock.now += 0.3  # the first two are done; two queued are decoding
                assert await reader.read() == ServerLoad(2.0, 1.0, 1.0, "vllm")
                sim.clock.now += 0.2  # one left, decoding alone
                assert await reader.read() == ServerLoad(1.0, 0.0, 0.5, "vllm")
        sim.clock.now += 1.0
        assert await reader.read() == ServerLoad(0.0, 0.0, 0.0, "vllm")
    finally:
        await reader.aclose()


@pytest.mark.anyio
async def test_without_slots_running_is_what_is_in_flight() -> None:
    sim = HeldSim(FIXED)
    reader = MetricsReader(URL, transport=sim.transport)
    try:
        with anyio.fail_after(10):
            async with sim.load(3):
                assert await reader.read() == ServerLoad(3.0, 0.0, None, "vllm")
        sim.clock.now += 0.2
        assert await reader.read() == ServerLoad(0.0, 0.0, None, "vllm")
    finally:
        await reader.aclose()


@pytest.mark.anyio
async def test_reader_sends_the_key_and_never_reports_it() -> None:
    transport = SimTransport(SimModel(SimConfig(api_key=KEY)))
    keyed = MetricsReader(URL, headers={"Authorization": f"Bearer {KEY}"}, transport=transport)
    bare = MetricsReader(URL, transport=transport)
    wrong = MetricsReader(URL, headers={"Authorization": "Bearer sk-wrong"}, transport=transport)
    try:
        assert await keyed.read() == ServerLoad(0.0, 0.0, None, "vllm")
        for reader in (bare, wrong):
            assert await reader.read() is None
            assert reader.last_error == "HTTP 401"
    finally:
        for reader in (keyed, bare, wrong):
            await reader.aclose()


@pytest.mark.anyio
async def test_sim_without_metrics_is_404_and_reads_none() -> None:
    reader = MetricsReader(URL, transport=SimTransport(SimModel(SimConfig(metrics=False))))
    try:
        assert await reader.read() is None
        assert reader.last_error == "HTTP 404"
    finally:
        await reader.aclose()


@pytest.mark.anyio
async def test_a_server_without_metrics_is_read_from_its_slots_then_only_there() -> None:
    asked: list[str] = []

    def llama_server(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.path)
        if request.url.path == "/slots":
            return httpx.Response(200, text=SLOTS)
        return httpx.Response(
            501, json={"error": {"message": "This server does not support metrics endpoint."}}
        )

    transport = httpx.MockTransport(llama_server)
    reader = MetricsReader(URL, transport=transport, fallback="http://sim.test/slots")
    try:
        for _ in range(3):
            load = await reader.read()
            assert load is not None and (load.running, load.slots) == (2.0, 4)
        assert asked == ["/metrics", "/slots", "/slots", "/slots"]  # found: the one page
    finally:
        await reader.aclose()


@pytest.mark.anyio
async def test_neither_page_says_why_for_each() -> None:
    transport = httpx.MockTransport(lambda _r: httpx.Response(404))
    reader = MetricsReader(URL, transport=transport, fallback="http://sim.test/slots")
    try:
        assert await reader.read() is None
        assert reader.last_error == "HTTP 404; HTTP 404"
    finally:
        await reader.aclose()


async def read_from(handler: Handler, **options: Any) -> MetricsReader:
    """A reader that has read once from `handler`; its `last_error` says what it made of it."""
    reader = MetricsReader(URL, transport=httpx.MockTransport(handler), **options)
    try:
        assert await reader.read() is None
    finally:
        await reader.aclose()
    return reader


async def hang(_request: httpx.Request) -> httpx.Response:
    await anyio.sleep_forever()
    raise AssertionError("unreachable")


async def drip(_request: httpx.Request) -> httpx.Response:
    async def body() -> Any:
        yield b"vllm:num_requests_running 1\n"
        await anyio.sleep_forever()

    return httpx.Response(200, content=body())


def refuse(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=request)


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("handler", "options", "why"),
    [
        (lambda _r: httpx.Response(404, text="404 page not found"), {}, "HTTP 404"),
        (lambda _r: httpx.Response(500, text=VLLM), {}, "HTTP 500"),
        (lambda _r: httpx.Response(302, headers={"location": "/login"}), {}, "HTTP 302"),
        (lambda _r: httpx.Response(200, text="<html>hello</html>"), {}, "no running and"),
        (lambda _r: httpx.Response(200, content=b"\xff\xfe\x00garbage"), {}, "no running and"),
        (lambda _r: httpx.Response(200, text=VLLM), {"max_bytes": 256}, "page larger than 256"),
        (refuse, {}, "ConnectError"),
        (hang, {"timeout": 0.05}, "no whole page within 0.05s"),
        (drip, {"timeout": 0.05}, "no whole page within 0.05s"),
    ],
    ids=["404", "500", "redirect", "html", "binary", "huge", "refused", "hang", "drip"],
)
async def test_server_misbehaviour_reads_none(
    handler: Handler, options: dict[str, Any], why: str
) -> None:
    with anyio.fail_after(5):
        reader = await read_from(handler, **options)
    assert reader.last_error is not None and reader.last_error.startswith(why)


@pytest.mark.anyio
async def test_sim_server_serves_metrics_over_a_real_socket() -> None:
    ready = anyio.Event()
    ports: list[int] = []

    def on_ready(port: int) -> None:
        ports.append(port)
        ready.set()

    model = SimModel(SimConfig(slots=4, models=('odd "name"',)))
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(SimServer(model).serve, "127.0.0.1", 0, on_ready)
            await ready.wait()
            reader = MetricsReader(metrics_url(f"http://127.0.0.1:{ports[0]}/v1"))
            try:
                assert await reader.read() == ServerLoad(0.0, 0.0, 0.0, "vllm")
            finally:
                await reader.aclose()
            tg.cancel_scope.cancel()


# --- `batchrun sim --no-metrics` ----------------------------------------------------------------


@pytest.mark.parametrize(("flags", "status"), [([], 200), (["--no-metrics"], 404)])
def test_sim_cli_no_metrics_turns_the_route_off(
    monkeypatch: pytest.MonkeyPatch, flags: list[str], status: int
) -> None:
    served = served_by_sim_cli(monkeypatch, flags)
    assert served.handle("GET", "/metrics", {}, b"").status == status
