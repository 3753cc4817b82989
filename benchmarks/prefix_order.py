"""Prefix-aware ordering against input order: 20 system prompts of ~1,000 tokens, each asked
PER_PREFIX short questions, the lines shuffled.

Each run is a fresh server and `batchrun submit` of the same file, once with `--order prefix`
(the default: lines sharing a long prompt prefix go out together) and once with `--order input`,
alternating, at a fixed concurrency equal to the server's slots (so only the order differs).

Servers:
- sim: `batchrun sim` with 32 slots, a prefill cost of 0.1 ms per prompt token and a prefix
  cache of 128 blocks (~8 of the 20 prompts: a cache that cannot hold them all, like a server
  whose KV memory is mostly taken by running requests);
- llama-server: llama.cpp's C++ server, `-np 8 -c 16384` (2,048 tokens a slot) with the tiny
  model; each slot keeps its last prompt's KV state and reuses its common prefix.

Printed per server and order: wall time, TTFT p50 and p95 (from the results), and the prompt
tokens the server computed rather than took from its cache (sim: /sim/stats; llama-server:
`llamacpp:prompt_tokens_total` from /metrics), medians of --repeat runs; then prefix over
input.

    python benchmarks/prefix_order.py [--servers sim,llama-server] [--per-prefix 500]
        [--llama-per-prefix 50] [--repeat 2]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from benchmarks.concurrency_matrix import (  # noqa: E402
    find_model,
    free_port,
    llama_server_binary,
    stop,
    wait_ready,
)
from tests.integration.helpers import cli_command, sim_stats, start_sim  # noqa: E402

PREFIXES = 20
SYSTEM_CHARS = 4000  # ~1,000 tokens at 4 characters a token (1,400 in the tiny model's)
WORDS = [
    "the",
    "a",
    "little",
    "girl",
    "named",
    "lily",
    "went",
    "to",
    "park",
    "and",
    "saw",
    "big",
    "dog",
    "who",
    "was",
    "very",
    "happy",
    "sun",
    "sky",
    "tree",
    "ball",
    "play",
    "friend",
    "mom",
    "said",
    "day",
    "home",
    "red",
    "blue",
    "small",
    "cat",
    "ran",
    "jumped",
    "laughed",
]
SIM = [
    "--slots",
    "32",
    "--ttft-ms",
    "10",
    "--prefill-ms-per-token",
    "0.1",
    "--tpot-ms",
    "1",
    "--min-output-tokens",
    "8",
    "--max-output-tokens",
    "16",
    "--prefix-cache-blocks",
    "128",
]
SLOTS = {"sim": 32, "llama-server": 8}


def write_input(path: Path, per_prefix: int, seed: int = 7) -> int:
    rng = random.Random(seed)
    systems = []
    for k in range(PREFIXES):
        words = [f"Instructions set {k}."]
        while sum(len(w) + 1 for w in words) < SYSTEM_CHARS:
            words.append(rng.choice(WORDS))
        systems.append(" ".join(words))
    lines = [
        {
            "id": f"s{k}-q{q}",
            "messages": [
                {"role": "system", "content": systems[k]},
                {"role": "user", "content": f"Question {q}: what did {rng.choice(WORDS)} do?"},
            ],
        }
        for k in range(PREFIXES)
        for q in range(per_prefix)
    ]
    rng.shuffle(lines)
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return len(lines)


def llama_server(log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    flags = f"--host 127.0.0.1 --port {port} -np 8 -c 16384 -t 1 --metrics"
    cmd = [str(llama_server_binary()), "-m", str(find_model()), *flags.split()]
    with log.open("ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=out, start_new_session=True)
    url = f"http://127.0.0.1:{port}/v1"
    wait_ready(url, proc, log)
    return proc, url


def computed_tokens(server: str, url: str) -> int:
    """Prompt tokens the server computed (not taken from its prefix cache)."""
    if server == "sim":
        cache = sim_stats(url).get("prefix_cache", {})
        return int(cache.get("prompt_tokens", 0) - cache.get("cached_tokens", 0))
    with urllib.request.urlopen(url.removesuffix("/v1") + "/metrics", timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("llamacpp:prompt_tokens_total"):
                return int(float(line.split()[-1]))
    return -1


def run_once(server: str, order: str, inp: Path, work: Path) -> dict[str, float]:
    home = Path(tempfile.mkdtemp(dir=work))
    env = {k: v for k, v in os.environ.items() if k not in ("BATCHRUN_HOME", "BATCHRUN_LEDGER")}
    if server == "sim":
        proc, url = start_sim("--port", "0", *SIM)
    else:
        proc, url = llama_server(home / "server.log")
    try:
        cmd = cli_command(
            home,
            "submit",
            str(inp),
            "--job",
            "p",
            "--base-url",
            url,
            "--order",
            order,
            "--concurrency",
            str(SLOTS[server]),
            "--max-tokens",
            "16",
            "--quiet",
        )
        started = time.monotonic()
        subprocess.run(cmd, check=True, env=env, capture_output=True)
        wall = time.monotonic() - started
        computed = computed_tokens(server, url)
    finally:
        if server == "sim":
            proc.kill()
            proc.wait()
        else:
            stop(proc)
    records = [json.loads(x) for x in (home / "outputs" / "p.jsonl").read_text().splitlines()]
    ttft = sorted(r["ttft_ms"] for r in records if r["ttft_ms"] is not None)
    done = sum(r["status"] == "done" for r in records)
    return {
        "wall": wall,
        "p50": ttft[len(ttft) // 2],
        "p95": ttft[int(len(ttft) * 0.95)],
        "computed": computed,
        "done": done,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--servers", default="sim,llama-server")
    parser.add_argument("--per-prefix", type=int, default=500)
    parser.add_argument("--llama-per-prefix", type=int, default=50)
    parser.add_argument("--repeat", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for server in args.servers.split(","):
            if server == "llama-server" and (llama_server_binary() is None or find_model() is None):
                print("llama-server: skipped (no binary or model; see .ci/build-llama-server)")
                continue
            per = args.per_prefix if server == "sim" else args.llama_per_prefix
            inp = work / f"{server}.jsonl"
            n = write_input(inp, per)
            runs: dict[str, list[dict[str, float]]] = {"prefix": [], "input": []}
            for i in range(args.repeat):
                for order in ("prefix", "input") if i % 2 == 0 else ("input", "prefix"):
                    runs[order].append(run_once(server, order, inp, work))
            print(
                f"{server}: {PREFIXES} prefixes x {per} = {n} items, shuffled, "
                f"concurrency {SLOTS[server]}; medians of {args.repeat}"
            )
            print(
                f"  {'order':7} {'wall':>8} {'ttft p50':>9} {'ttft p95':>9} "
                f"{'computed prompt tokens':>23} {'done':>6}"
            )
            med = {}
            for order, got in runs.items():
                med[order] = {k: statistics.median(r[k] for r in got) for k in got[0]}
                m = med[order]
                print(
                    f"  {order:7} {m['wall']:7.1f}s {m['p50']:7.0f}ms {m['p95']:7.0f}ms "
                    f"{m['computed']:23,.0f} {m['done']:6.0f}"
                )
            p, i = med["prefix"], med["input"]
            print(
                f"  prefix / input: wall {p['wall'] / i['wall']:.2f}, ttft p50 "
                f"{p['p50'] / i['p50']:.2f}, computed tokens "
                f"{p['computed'] / max(1, i['computed']):.2f}"
            )


if __name__ == "__main__":
    main()
