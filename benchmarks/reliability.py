"""Reliability report: a chaos run and a crash loop through the real CLI, with what they cost.

1. Chaos: N items through `batchrun sim` with ~23% of responses faulty, every fault kind the
   simulator has (429 with Retry-After, 500/502/503/504, reset, hang, cut, non-JSON, empty).
2. Crash loop: the CLI killed with SIGKILL at K random moments and started again each time.

For each it prints the items, the faults injected by kind (the simulator's own count), the
retries, items lost and items recorded twice (both must be 0), and the requests re-sent after
crashes (answers the simulator gave twice for the same prompt).

    python benchmarks/reliability.py [--items 2000] [--kills 10] [--seed 7]
"""

from __future__ import annotations

import argparse
import random
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' CLI helpers

from batchrun.sim import prompt_tag
from tests.integration.helpers import (
    CHAOS_FAULTS,
    CLI,
    audited_records,
    fault_args,
    install_audit,
    sim_stats,
    start_sim,
    write_prompts,
)


def check(cli: CLI, job: str, prompts: list[str]) -> dict[str, int]:
    """Lost and duplicated items: the ledger, the results file, and an audit trigger that saw
    every result commit (installed from outside batchrun before the run)."""
    items = cli.items(job)
    output = cli.output(job)
    wrong = sum(
        1
        for o, p in zip(output, prompts, strict=False)
        if not (o["output"] or "").startswith(prompt_tag(p))
    )
    committed, distinct = audited_records(cli.home / "jobs" / "ledger.db", job)
    return {
        "lost": len(prompts) - sum(1 for r in items if r["status"] == "done"),
        "committed": committed,
        "recorded_twice": committed - distinct,
        "wrong_output": wrong + abs(len(output) - len(prompts)),
        "attempts": sum(r["attempts"] for r in items),
    }


def report(title: str, n: int, stats: dict[str, Any], found: dict[str, int], extra: str) -> None:
    faults = stats["faults"]
    total = sum(faults.values())
    print(f"\n{title}")
    print(f"  items                      {n}")
    print(f"  requests                   {stats['requests']}")
    print(f"  faults injected            {total} ({total / max(1, stats['requests']):.1%})")
    for kind in sorted(faults):
        print(f"    {kind:<8}                 {faults[kind]}")
    print(f"  retries                    {found['attempts'] - n}")
    print(f"  results committed          {found['committed']}")
    print(f"  items lost                 {found['lost']}")
    print(f"  items recorded twice       {found['recorded_twice']}")
    print(f"  outputs not their input's  {found['wrong_output']}")
    print(f"  re-sent after crashes      {stats['resent_after_success']}")
    if extra:
        print(f"  {extra}")


def chaos(home: Path, items: int, seed: int) -> None:
    server, url = start_sim(
        "--port", "0", "--ttft-ms", "0", "--tpot-ms", "0", *fault_args(CHAOS_FAULTS, seed)
    )
    try:
        cli = CLI(home)
        inp = home / "chaos.jsonl"
        prompts = write_prompts(inp, items)
        cli.run("submit", str(inp), "--base-url", url, "--model", "sim-1", "--no-run")
        install_audit(home / "jobs" / "ledger.db")
        started = time.perf_counter()
        done = cli.run(
            "resume",
            "chaos",
            "--concurrency",
            "32",
            "--timeout",
            "3",
            "--max-attempts",
            "12",
            "--quiet",
            timeout=1800,
        )
        took = time.perf_counter() - started
        report(
            "chaos",
            items,
            sim_stats(url),
            check(cli, "chaos", prompts),
            f"exit code {done.returncode}, {took:.1f}s",
        )
    finally:
        server.kill()


def crash_loop(home: Path, items: int, kills: int, seed: int) -> None:
    server, url = start_sim("--port", "0", "--ttft-ms", "10", "--tpot-ms", "1")
    try:
        cli = CLI(home)
        inp = home / "loop.jsonl"
        prompts = write_prompts(inp, items)
        rng = random.Random(seed)
        command = (
            "submit",
            str(inp),
            "--base-url",
            url,
            "--model",
            "sim-1",
            "--concurrency",
            "8",
            "--quiet",
        )
        cli.run(*command, "--no-run")
        install_audit(home / "jobs" / "ledger.db")
        step = max(1, items // (kills + 5))
        done_kills = 0
        while done_kills < kills:
            proc = cli.start(*command)
            # Mid-run every time: once this run has committed new results, a random moment
            # later (requests in flight, results in the commit window, or a commit) kill it.
            cli.wait_for("loop", step * (done_kills + 1), proc, timeout=600)
            time.sleep(rng.uniform(0.0, 0.3))
            if proc.poll() is not None:
                break
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            done_kills += 1
        final = cli.run(*command, timeout=1800)
        report(
            f"crash loop ({done_kills} x kill -9)",
            items,
            sim_stats(url),
            check(cli, "loop", prompts),
            f"final exit code {final.returncode}",
        )
    finally:
        server.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=2000)
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "a").mkdir()
        (Path(tmp) / "b").mkdir()
        chaos(Path(tmp) / "a", args.items, args.seed)
        crash_loop(Path(tmp) / "b", args.items, args.kills, args.seed)


if __name__ == "__main__":
    main()
