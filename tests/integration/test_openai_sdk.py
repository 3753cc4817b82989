"""Interop with the official OpenAI Python SDK (a test dependency only): its client talks to
`batchrun sim`, and a Batch API input file runs unchanged with results in the Batch API's
output shape, which the SDK's own types parse."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import openai
from openai.types import Completion as SDKCompletion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from tests.integration.helpers import CLI

MESSAGES = [{"role": "user", "content": "Describe a steel bottle in five words."}]


def test_the_sdk_client_completes_chat_and_completions_against_the_simulator(
    sim_server: Callable[..., str],
) -> None:
    client = openai.OpenAI(
        base_url=sim_server("--ttft-ms", "1", "--tpot-ms", "0"), api_key="unused", max_retries=0
    )
    chat = client.chat.completions.create(model="sim-1", messages=MESSAGES, max_tokens=20)
    assert isinstance(chat, ChatCompletion)
    assert chat.choices[0].message.content and chat.choices[0].message.content.startswith("[sim:")
    assert chat.usage is not None and chat.usage.completion_tokens >= 1
    assert chat.choices[0].finish_reason in ("stop", "length")

    chunks = list(
        client.chat.completions.create(
            model="sim-1",
            messages=MESSAGES,
            max_tokens=20,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(isinstance(c, ChatCompletionChunk) for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat.choices[0].message.content  # the same prompt, the same answer
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens

    plain = client.completions.create(model="sim-1", prompt="Once upon a time", max_tokens=5)
    assert isinstance(plain, SDKCompletion)
    assert plain.choices[0].finish_reason == "length" and plain.usage is not None
    assert plain.usage.completion_tokens == 5
    streamed = list(
        client.completions.create(
            model="sim-1", prompt="Once upon a time", max_tokens=5, stream=True
        )
    )
    assert all(isinstance(c, SDKCompletion) for c in streamed)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == plain.choices[0].text


def test_a_batch_api_file_runs_unchanged_and_results_have_the_batch_output_shape(
    cli: CLI, tmp_path: Path, sim_server: Callable[..., str]
) -> None:
    url = sim_server("--ttft-ms", "1", "--tpot-ms", "0")
    inp = tmp_path / "batch_input.jsonl"
    lines = [
        {
            "custom_id": f"request-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "sim-1",
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": f"Item {i}?"},
                ],
                "max_tokens": 30,
            },
        }
        for i in range(25)
    ]
    inp.write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = cli.run("submit", str(inp), "--base-url", url, "--quiet")
    assert result.returncode == 0, result.stderr
    out = tmp_path / "batch_output.jsonl"
    result = cli.run("export", "batch_input", "--format", "openai", "-o", str(out))
    assert result.returncode == 0, result.stderr
    records = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["custom_id"] for r in records] == [line["custom_id"] for line in lines]
    for record in records:
        # https://platform.openai.com/docs/api-reference/batch/request-output
        assert set(record) == {"id", "custom_id", "response", "error"}
        assert record["error"] is None and record["id"].startswith("batch_req_")
        response = record["response"]
        assert set(response) == {"status_code", "request_id", "body"}
        assert response["status_code"] == 200 and isinstance(response["request_id"], str)
        body = ChatCompletion.model_validate(response["body"])
        assert body.object == "chat.completion" and body.model == "sim-1"
        assert body.choices[0].message.role == "assistant"
        assert body.choices[0].message.content and body.choices[0].message.content.startswith(
            "[sim:"
        )
        assert body.usage is not None
        assert body.usage.total_tokens == body.usage.prompt_tokens + body.usage.completion_tokens
    assert len({r["id"] for r in records}) == len(records)
