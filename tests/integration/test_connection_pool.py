"""The sharded connection pool against a real `batchrun sim` on 127.0.0.1: it spreads streams
over its shards, frees a shard's slot however a response ends, and keeps no slot on errors."""

from __future__ import annotations

from collections.abc import Callable

import anyio
import httpx
import orjson
import pytest

from batchrun.backends.pool import ShardedTransport
from tests.integration.helpers import free_port


def test_shard_count_follows_the_connection_limit() -> None:
    assert ShardedTransport(10).shards == 1
    assert ShardedTransport(32).shards == 1
    assert ShardedTransport(33).shards == 2
    assert ShardedTransport(256).shards == 8


def _body(i: int) -> bytes:
    return orjson.dumps(
        {"model": "sim-1", "stream": True, "messages": [{"role": "user", "content": f"p{i}"}]}
    )


def test_concurrent_streams_spread_over_shards_and_all_slots_come_back(
    sim_server: Callable[..., str],
) -> None:
    url = sim_server("--ttft-ms", "50", "--tpot-ms", "5")
    transport = ShardedTransport(64, shard_size=16)
    most_busy: list[int] = []
    answers: list[str] = []

    async def main() -> None:
        async with httpx.AsyncClient(transport=transport, timeout=30) as client:

            async def one(i: int) -> None:
                async with client.stream(
                    "POST", url + "/chat/completions", content=_body(i)
                ) as resp:
                    most_busy.append(max(transport.busy))
                    text = "".join([line async for line in resp.aiter_lines()])
                    answers.append(text)

            async with anyio.create_task_group() as tg:
                for i in range(64):
                    tg.start_soon(one, i)

    anyio.run(main)
    assert transport.shards == 4
    assert len(answers) == 64 and all("[DONE]" in a for a in answers)
    # 64 streams over 4 shards of 16: the least-busy choice never overfills one.
    assert max(most_busy) <= 16
    assert transport.busy == (0, 0, 0, 0)


def test_a_response_closed_early_frees_its_slot(sim_server: Callable[..., str]) -> None:
    url = sim_server("--tpot-ms", "5", "--min-output-tokens", "40")
    transport = ShardedTransport(4)

    async def main() -> None:
        async with httpx.AsyncClient(transport=transport, timeout=30) as client:
            async with client.stream("POST", url + "/chat/completions", content=_body(1)) as resp:
                async for _line in resp.aiter_lines():
                    break  # walk away after the first line
            assert transport.busy == (0,)
            resp = await client.post(url + "/chat/completions", content=_body(2))
            assert resp.status_code == 200
            assert transport.busy == (0,)

    anyio.run(main)


def test_a_refused_connection_keeps_no_slot() -> None:
    transport = ShardedTransport(4)

    async def main() -> None:
        async with httpx.AsyncClient(transport=transport, timeout=5) as client:
            with pytest.raises(httpx.ConnectError):
                await client.get(f"http://127.0.0.1:{free_port()}/v1/models")
        assert transport.busy == (0,)

    anyio.run(main)
