"""The simulator's Files and Batches endpoints, driven by the official OpenAI SDK's client (a
test dependency) over the in-process transport, on a fake clock: completion, expiry with half
the lines done, cancellation, failed lines, validation, listing by metadata."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from batchrun.sim import SimConfig, SimModel, SimTransport
from tests.fakes import FakeTime


def batch_file(n: int, url: str = "/v1/chat/completions") -> bytes:
    lines = [
        {
            "custom_id": f"req-{i}",
            "method": "POST",
            "url": url,
            "body": {"model": "sim-1", "messages": [{"role": "user", "content": f"prompt {i}"}]},
        }
        for i in range(n)
    ]
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def client(fake: FakeTime, **config: Any) -> tuple[openai.AsyncOpenAI, SimModel]:
    model = SimModel(SimConfig(**config), clock=fake.clock)
    http = httpx.AsyncClient(transport=SimTransport(model))
    sdk = openai.AsyncOpenAI(
        base_url="http://sim.test/v1", api_key="unused", http_client=http, max_retries=0
    )
    return sdk, model


async def create(sdk: openai.AsyncOpenAI, content: bytes, **metadata: str) -> Any:
    uploaded = await sdk.files.create(file=("in.jsonl", content), purpose="batch")
    return await sdk.batches.create(
        input_file_id=uploaded.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata=metadata or None,
    )


async def lines(sdk: openai.AsyncOpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    content = await sdk.files.content(file_id)
    return [json.loads(line) for line in content.text.splitlines()]


@pytest.mark.anyio
async def test_a_batch_runs_to_completion_and_its_output_maps_back_by_custom_id() -> None:
    fake = FakeTime()
    sdk, _model = client(fake, batch_seconds=10.0)
    batch = await create(sdk, batch_file(20), job="j", chunk="1")
    assert batch.status == "in_progress" and batch.request_counts.total == 20
    fake.now += 5
    half = await sdk.batches.retrieve(batch.id)
    assert half.status == "in_progress" and half.request_counts.completed == 10
    fake.now += 5
    done = await sdk.batches.retrieve(batch.id)
    assert done.status == "completed" and done.error_file_id is None
    out = await lines(sdk, done.output_file_id)
    assert sorted(r["custom_id"] for r in out) == sorted(f"req-{i}" for i in range(20))
    first = out[0]["response"]
    assert first["status_code"] == 200 and first["body"]["choices"][0]["message"]["content"]
    listed = [b async for b in sdk.batches.list(limit=10)]
    assert [b.metadata for b in listed] == [{"job": "j", "chunk": "1"}]


@pytest.mark.anyio
async def test_an_expired_batch_keeps_what_it_answered_and_names_the_rest() -> None:
    fake = FakeTime()
    sdk, _model = client(fake, batch_seconds=10.0, batch_window_s=5.0)
    batch = await create(sdk, batch_file(20))
    fake.now += 6
    expired = await sdk.batches.retrieve(batch.id)
    assert expired.status == "expired"
    out, errors = await lines(sdk, expired.output_file_id), await lines(sdk, expired.error_file_id)
    assert len(out) == 12 and len(errors) == 8
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}
    assert {r["custom_id"] for r in out + errors} == {f"req-{i}" for i in range(20)}


@pytest.mark.anyio
async def test_a_cancelled_batch_ends_with_what_it_answered() -> None:
    fake = FakeTime()
    sdk, _model = client(fake, batch_seconds=10.0)
    batch = await create(sdk, batch_file(10))
    fake.now += 3
    cancelled = await sdk.batches.cancel(batch.id)
    assert cancelled.status == "cancelled" and cancelled.request_counts.completed == 3
    errors = await lines(sdk, cancelled.error_file_id)
    assert len(errors) == 7 and {e["error"]["code"] for e in errors} == {"batch_cancelled"}


@pytest.mark.anyio
async def test_lines_the_server_fails_go_to_the_error_file_with_their_status() -> None:
    fake = FakeTime()
    sdk, _model = client(fake, batch_seconds=1.0, faults={"500": 0.3}, fault_seed=3)
    batch = await create(sdk, batch_file(40))
    fake.now += 2
    done = await sdk.batches.retrieve(batch.id)
    out, errors = await lines(sdk, done.output_file_id), await lines(sdk, done.error_file_id)
    assert done.status == "completed" and len(out) + len(errors) == 40
    assert errors and {e["response"]["status_code"] for e in errors} == {500}
    assert done.request_counts.failed == len(errors)


@pytest.mark.anyio
async def test_an_input_over_the_limit_or_with_a_bad_line_fails_at_validation() -> None:
    fake = FakeTime()
    sdk, model = client(fake, batch_max_requests=5)
    too_many = await create(sdk, batch_file(6))
    assert too_many.status == "failed" and too_many.errors is not None
    assert too_many.errors.data and too_many.errors.data[0].code == "too_many_requests"
    wrong_url = await create(sdk, batch_file(2, url="/v1/embeddings"))
    assert wrong_url.status == "failed"
    assert model.batches.created == 2
