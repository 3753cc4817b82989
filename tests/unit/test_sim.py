"""The simulator: the pure SimModel, and SimServer over a real socket on 127.0.0.1."""

from __future__ import annotations

from typing import Any

import anyio
import httpx
import orjson
import pytest

from batchrun.sim import SimConfig, SimModel, SimServer, prompt_tag, prompt_text

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def chat_body(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": "sim-1", "messages": [{"role": "user", "content": content}], **extra}


def post(model: SimModel, path: str, body: dict[str, Any], **headers: str) -> Any:
    return model.handle("POST", path, dict(headers), orjson.dumps(body))


def json_of(reply: Any) -> Any:
    assert reply.events is None
    return orjson.loads(reply.body)


def sse_data(events: list[tuple[float, bytes]]) -> list[str]:
    """The `data:` payloads of a streamed reply, in order."""
    out = []
    for _delay, raw in events:
        text = raw.decode()
        assert text.startswith("data: "), text
        assert text.endswith("\n\n"), text
        out.append(text[len("data: ") : -2])
    return out


def natural_length(content: str) -> int:
    reply = post(SimModel(), CHAT, chat_body(content))
    return int(json_of(reply)["usage"]["completion_tokens"])


# --- pure model -----------------------------------------------------------------------------


def test_same_prompt_same_answer_tagged_with_prompt() -> None:
    body = chat_body("What is the capital of France?")
    first = json_of(post(SimModel(), CHAT, body))
    second = json_of(post(SimModel(), CHAT, body))
    text = first["choices"][0]["message"]["content"]
    assert text == second["choices"][0]["message"]["content"]
    assert text.startswith(prompt_tag(prompt_text("chat", body)))
    assert text.startswith("[sim:")


def test_different_prompts_differ() -> None:
    model = SimModel()
    a = json_of(post(model, CHAT, chat_body("prompt one")))["choices"][0]["message"]["content"]
    b = json_of(post(model, CHAT, chat_body("prompt two")))["choices"][0]["message"]["content"]
    assert a != b
    assert prompt_tag("prompt one") != prompt_tag("prompt two")


def test_prompt_text_joins_messages_and_reads_prompt() -> None:
    body = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hi"},
        ]
    }
    assert prompt_text("chat", body) == "be brief\nhi"
    assert prompt_text("completions", {"prompt": "once upon"}) == "once upon"


def test_max_tokens_below_natural_length_truncates() -> None:
    content = "tell me a long story"
    natural = natural_length(content)
    assert natural > 3
    limit = natural - 2
    data = json_of(post(SimModel(), CHAT, chat_body(content, max_tokens=limit)))
    choice = data["choices"][0]
    assert choice["finish_reason"] == "length"
    assert data["usage"]["completion_tokens"] == limit
    assert len(choice["message"]["content"].split()) == limit


def test_max_tokens_above_natural_length_stops() -> None:
    content = "short one"
    natural = natural_length(content)
    data = json_of(post(SimModel(), CHAT, chat_body(content, max_tokens=natural + 100)))
    assert data["choices"][0]["finish_reason"] == "stop"
    assert data["usage"]["completion_tokens"] == natural


def test_non_stream_reply_shape() -> None:
    body = chat_body("hello there")
    reply = post(SimModel(), CHAT, body)
    assert reply.status == 200
    assert reply.headers["content-type"] == "application/json"
    data = json_of(reply)
    assert data["object"] == "chat.completion"
    choice = data["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] == "stop"
    usage = data["usage"]
    assert usage["prompt_tokens"] == 2  # "hello there"
    assert usage["completion_tokens"] == len(choice["message"]["content"].split())
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_requests_counter_counts_completions_only() -> None:
    model = SimModel()
    model.handle("GET", "/v1/models", {}, b"")
    post(model, CHAT, chat_body("a"))
    post(model, COMPLETIONS, {"prompt": "b"})
    assert model.requests == 2


def test_stream_events_are_sse_and_end_with_done() -> None:
    body = chat_body("stream me", stream=True)
    reply = post(SimModel(), CHAT, body)
    assert reply.status == 200
    assert reply.headers["content-type"] == "text/event-stream"
    assert reply.events is not None
    payloads = sse_data(reply.events)
    assert payloads[-1] == "[DONE]"
    chunks = [orjson.loads(p) for p in payloads[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert not any("usage" in c for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    plain = json_of(post(SimModel(), CHAT, chat_body("stream me")))
    assert text == plain["choices"][0]["message"]["content"]
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "stop"
    assert all(f is None for f in finishes[:-1])


def test_stream_usage_chunk_only_with_include_usage() -> None:
    without = post(SimModel(), CHAT, chat_body("x", stream=True, stream_options={}))
    with_usage = post(
        SimModel(), CHAT, chat_body("x", stream=True, stream_options={"include_usage": True})
    )
    assert without.events is not None and with_usage.events is not None
    no_usage = [orjson.loads(p) for p in sse_data(without.events)[:-1]]
    assert not any("usage" in c for c in no_usage)
    chunks = [orjson.loads(p) for p in sse_data(with_usage.events)[:-1]]
    usage_chunks = [c for c in chunks if "usage" in c]
    assert len(usage_chunks) == 1
    assert usage_chunks[0] is chunks[-1]
    assert usage_chunks[0]["choices"] == []
    plain = json_of(post(SimModel(), CHAT, chat_body("x")))
    assert usage_chunks[0]["usage"] == plain["usage"]
    assert len(with_usage.events) == len(without.events) + 1


def test_stream_delays_are_ttft_then_tpot() -> None:
    model = SimModel(SimConfig(ttft_ms=200.0, tpot_ms=20.0))
    reply = post(model, CHAT, chat_body("timing please", stream=True))
    assert reply.events is not None
    token_events = []
    for delay, raw in reply.events:
        payload = raw.decode()[len("data: ") : -2]
        if payload == "[DONE]":
            assert delay == 0.0
            continue
        choice = orjson.loads(payload)["choices"][0]
        if choice["delta"].get("content"):
            token_events.append(delay)
        else:
            assert delay == 0.0  # role chunk and finish chunk come at once
    n_out = json_of(post(SimModel(), CHAT, chat_body("timing please")))["usage"][
        "completion_tokens"
    ]
    assert len(token_events) == n_out
    assert token_events[0] == pytest.approx(0.2)
    assert token_events[1:] == [pytest.approx(0.02)] * (n_out - 1)


def test_non_stream_delay_is_ttft_plus_tpot_per_token() -> None:
    model = SimModel(SimConfig(ttft_ms=100.0, tpot_ms=10.0))
    reply = post(model, CHAT, chat_body("delay please"))
    n_out = json_of(reply)["usage"]["completion_tokens"]
    assert reply.delay == pytest.approx(0.1 + 0.01 * (n_out - 1))


def test_models_lists_configured_models() -> None:
    model = SimModel(SimConfig(models=("alpha-1", "beta-2")))
    for path in ("/v1/models", "/models"):
        reply = model.handle("GET", path, {}, b"")
        assert reply.status == 200
        data = json_of(reply)
        assert data["object"] == "list"
        assert [m["id"] for m in data["data"]] == ["alpha-1", "beta-2"]


def test_api_key_required() -> None:
    key = "sk-right-key-123"
    wrong = "sk-wrong-key-456"
    model = SimModel(SimConfig(api_key=key))
    missing = post(model, CHAT, chat_body("hi"))
    assert missing.status == 401
    bad = post(model, CHAT, chat_body("hi"), authorization=f"Bearer {wrong}")
    assert bad.status == 401
    assert wrong.encode() not in bad.body
    assert key.encode() not in bad.body
    assert "error" in json_of(bad)
    listing = model.handle("GET", "/v1/models", {"authorization": f"Bearer {wrong}"}, b"")
    assert listing.status == 401
    good = post(model, CHAT, chat_body("hi"), authorization=f"Bearer {key}")
    assert good.status == 200
    assert model.requests == 1


def test_strict_models_unknown_model_is_404() -> None:
    strict = SimModel(SimConfig(models=("sim-1",), strict_models=True))
    reply = post(
        strict, CHAT, {"model": "gpt-nope", "messages": [{"role": "user", "content": "x"}]}
    )
    assert reply.status == 404
    assert "gpt-nope" in json_of(reply)["error"]["message"]
    assert post(strict, CHAT, chat_body("x")).status == 200
    lenient = SimModel(SimConfig(models=("sim-1",)))
    assert post(lenient, CHAT, {"model": "other", "messages": []}).status == 200


def test_bad_json_body_is_400() -> None:
    model = SimModel()
    reply = model.handle("POST", CHAT, {}, b"{not json")
    assert reply.status == 400
    assert json_of(reply)["error"]["type"] == "invalid_request_error"
    assert model.handle("POST", CHAT, {}, b"[1, 2]").status == 400
    assert post(model, CHAT, {"model": "sim-1"}).status == 400  # no messages
    assert model.requests == 0


def test_unknown_path_is_404() -> None:
    model = SimModel()
    assert model.handle("POST", "/v1/embeddings", {}, b"{}").status == 404
    assert model.handle("GET", "/nowhere", {}, b"").status == 404
    assert model.handle("GET", CHAT, {}, b"").status == 404


def test_completions_endpoint_uses_text() -> None:
    body = {"model": "sim-1", "prompt": "Once upon a time"}
    data = json_of(post(SimModel(), COMPLETIONS, body))
    assert data["object"] == "text_completion"
    choice = data["choices"][0]
    assert "message" not in choice
    assert choice["text"].startswith(prompt_tag("Once upon a time"))
    streamed = post(SimModel(), COMPLETIONS, {**body, "stream": True})
    assert streamed.events is not None
    chunks = [orjson.loads(p) for p in sse_data(streamed.events)[:-1]]
    assert all("delta" not in c["choices"][0] for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]


# --- real server on 127.0.0.1 -----------------------------------------------------------------


@pytest.mark.anyio
async def test_sim_server_over_real_socket() -> None:
    model = SimModel(SimConfig(models=("sim-1",)))
    ready = anyio.Event()
    ports: list[int] = []

    def on_ready(port: int) -> None:
        ports.append(port)
        ready.set()

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(SimServer(model).serve, "127.0.0.1", 0, on_ready)
            await ready.wait()
            base = f"http://127.0.0.1:{ports[0]}"
            expected = json_of(post(SimModel(), CHAT, chat_body("over the wire")))
            expected_text = expected["choices"][0]["message"]["content"]
            async with httpx.AsyncClient(base_url=base) as client:
                plain = await client.post(CHAT, json=chat_body("over the wire"))
                assert plain.status_code == 200
                assert plain.headers["connection"] == "keep-alive"
                assert plain.json()["choices"][0]["message"]["content"] == expected_text
                first_addr = plain.extensions["network_stream"].get_extra_info("client_addr")

                lines = []
                streamed_body = chat_body(
                    "over the wire", stream=True, stream_options={"include_usage": True}
                )
                async with client.stream("POST", CHAT, json=streamed_body) as resp:
                    assert resp.status_code == 200
                    assert resp.headers["content-type"] == "text/event-stream"
                    assert resp.headers["transfer-encoding"] == "chunked"
                    second_addr = resp.extensions["network_stream"].get_extra_info("client_addr")
                    async for line in resp.aiter_lines():
                        if line:
                            lines.append(line)
                assert lines[-1] == "data: [DONE]"
                chunks = [orjson.loads(line[len("data: ") :]) for line in lines[:-1]]
                text = "".join(
                    c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]
                )
                assert text == expected_text
                assert chunks[-1]["usage"] == expected["usage"]

                models = await client.get("/v1/models")
                assert models.json()["data"][0]["id"] == "sim-1"
                third_addr = models.extensions["network_stream"].get_extra_info("client_addr")
            # keep-alive: the sequential requests went over one and the same connection
            assert first_addr == second_addr == third_addr
            assert model.requests == 2

            # and again on a raw socket: two requests, one connection
            async with await anyio.connect_tcp("127.0.0.1", ports[0]) as sock:
                for _ in range(2):
                    await sock.send(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n\r\n")
                    data = b""
                    while b"\r\n\r\n" not in data:
                        data += await sock.receive()
                    head, _, rest = data.partition(b"\r\n\r\n")
                    assert head.startswith(b"HTTP/1.1 200 OK")
                    length = int(
                        next(
                            line.split(b":", 1)[1]
                            for line in head.split(b"\r\n")
                            if line.lower().startswith(b"content-length:")
                        )
                    )
                    while len(rest) < length:
                        rest += await sock.receive()
                    assert orjson.loads(rest)["data"][0]["id"] == "sim-1"
            tg.cancel_scope.cancel()


def test_metrics_report_the_load_under_vllms_names() -> None:
    model = SimModel(SimConfig(slots=4, ttft_ms=60_000, models=('we"ird\\name',)))
    post(model, CHAT, chat_body("one"))
    reply = model.handle("GET", "/metrics", {}, b"")
    assert reply.status == 200 and reply.headers["content-type"].startswith("text/plain")
    labels = '{engine="0",model_name="we\\"ird\\\\name"}'
    assert reply.body.decode().splitlines() == [
        "# TYPE vllm:num_requests_running gauge",
        f"vllm:num_requests_running{labels} 1.0",
        "# TYPE vllm:num_requests_waiting gauge",
        f"vllm:num_requests_waiting{labels} 0.0",
        "# TYPE vllm:kv_cache_usage_perc gauge",
        f"vllm:kv_cache_usage_perc{labels} 0.25",
        "# HELP vllm:prefix_cache_queries_total "
        "Prefix cache queries, in terms of number of queried tokens.",
        "# TYPE vllm:prefix_cache_queries_total counter",
        f"vllm:prefix_cache_queries_total{labels} 1.0",
        "# HELP vllm:prefix_cache_hits_total "
        "Prefix cache hits, in terms of number of cached tokens.",
        "# TYPE vllm:prefix_cache_hits_total counter",
        f"vllm:prefix_cache_hits_total{labels} 0.0",
    ]
    assert model.requests == 1  # reading the metrics is no request


def test_metrics_without_slots_have_no_kv_usage_and_can_be_off() -> None:
    text = SimModel().handle("GET", "/metrics/", {}, b"").body.decode()
    assert "vllm:num_requests_waiting" in text and "kv_cache" not in text
    off = SimModel(SimConfig(metrics=False)).handle("GET", "/metrics", {}, b"")
    assert off.status == 404 and json_of(off)["error"]["type"] == "not_found_error"


def test_capacity_settings_without_slots_are_refused_not_ignored() -> None:
    """--queue-limit, --tpot-slope and --gate-status model a batch of slots: without --slots
    they were accepted and did nothing (the tools review's suspicion)."""
    from batchrun.sim.settings import config_problem

    assert config_problem(SimConfig(queue_limit=4)) == (
        "queue_limit without slots does nothing: give slots too"
    )
    assert "tpot_slope" in (config_problem(SimConfig(tpot_slope=0.5)) or "")
    assert config_problem(SimConfig(slots=8, queue_limit=4, tpot_slope=0.5)) is None
    assert config_problem(SimConfig()) is None
