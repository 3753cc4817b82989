"""Run a copy of the OpenAI cookbook's api_request_parallel_processor.py the way client_cost.py
compares it: against a local http:// server, with at most C requests in flight.

The repository holds none of the cookbook's code: give the path to your copy. Three things are
changed from outside, none in its request path:

- its URL parser accepts only https:// URLs, so `api_endpoint_from_url` is replaced by one that
  takes what follows `/v1/`;
- it keeps no cap on requests in flight (its budgets pace starts, not concurrency), so its
  aiohttp session gets a connector of C connections (aiohttp queues the rest): C in flight;
- when tiktoken cannot load `cl100k_base` (this machine reaches no network but package
  registries, and tiktoken downloads its tables), a stand-in counts a token per 4 characters.
  It costs less than tiktoken's encoder, so it can only flatter the cookbook.

    python benchmarks/cookbook_runner.py COPY.py --concurrency 32 --requests R.jsonl \\
        --save OUT.jsonl --url http://127.0.0.1:PORT/v1/chat/completions
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

import aiohttp

BUDGET = 10**12  # requests and tokens per minute: too large to bind


def tiktoken_or_stand_in() -> None:
    try:
        import tiktoken

        tiktoken.get_encoding("cl100k_base")
    except Exception:  # not installed, or its tables cannot be downloaded here

        class Encoding:
            def encode(self, text: str) -> list[int]:
                return [0] * (len(text) // 4 + 1)

        stand_in = types.ModuleType("tiktoken")
        stand_in.get_encoding = lambda _name: Encoding()  # type: ignore[attr-defined]
        sys.modules["tiktoken"] = stand_in


def load(path: Path, concurrency: int) -> Any:
    spec = importlib.util.spec_from_file_location("cookbook_processor", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

    def session() -> aiohttp.ClientSession:
        return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency))

    module.aiohttp = types.SimpleNamespace(ClientSession=session)
    module.api_endpoint_from_url = lambda url: url.split("/v1/", 1)[1]
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("script", type=Path)
    parser.add_argument("--concurrency", type=int, required=True)
    parser.add_argument("--requests", required=True)
    parser.add_argument("--save", required=True)
    parser.add_argument("--url", required=True)
    args = parser.parse_args()
    tiktoken_or_stand_in()
    processor = load(args.script, args.concurrency)
    run = processor.process_api_requests_from_file(
        requests_filepath=args.requests,
        save_filepath=args.save,
        request_url=args.url,
        api_key="sk-not-needed",
        max_requests_per_minute=float(BUDGET),
        max_tokens_per_minute=float(BUDGET),
        token_encoding_name="cl100k_base",
        max_attempts=3,
        logging_level=40,
    )
    asyncio.run(run)


if __name__ == "__main__":
    main()
