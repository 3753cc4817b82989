"""One bench invocation: self-test, then every endpoint in turn under identical settings, then
the files. Endpoints run one after another, never at once, so they do not compete for this
machine's CPU and network."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from batchrun import endpoints
from batchrun.backends import Transport
from batchrun.backends.build import build_backend
from batchrun.bench import plots, report
from batchrun.bench.load import Cell, LoadPlan, sweep
from batchrun.bench.metrics import knee, summarize
from batchrun.bench.selftest import client_bound, self_test
from batchrun.bench.suite import Suite
from batchrun.config import RunSpec, preset_for
from batchrun.endpoints import shown_endpoint
from batchrun.errors import RequestError, UsageError


@dataclass(frozen=True)
class Endpoint:
    name: str
    spec: RunSpec  # backend preset, base URL, model, key variable, timeout


def parse_endpoint(text: str, resolve_spec: Callable[[dict[str, Any]], RunSpec]) -> Endpoint:
    """NAME=URL[,model=M][,key=VAR][,backend=PRESET] (see endpoints.py; bench measures one
    endpoint at a time, so weight and pacing parts have no meaning here)."""
    e = endpoints.parse_endpoint(text)
    if e.weight != 1.0 or e.rpm is not None or e.tpm is not None:
        raise UsageError(f"--endpoint {e.name}: bench takes model=, key= and backend= only")
    options = {"base_url": e.url, "model": e.model, "api_key_env": e.key, "backend": e.backend}
    return Endpoint(e.name, resolve_spec({k: v for k, v in options.items() if v is not None}))


async def run_bench(
    endpoints: list[Endpoint],
    suite: Suite,
    plan: LoadPlan,
    folder: Path,
    *,
    label: str,
    guided: bool = True,
    selftest: bool = True,
    transport: Transport | None = None,
    say: Callable[[str], None] = print,
    show: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Measure, write results.json, summary.csv, report.md and charts; return the results.
    Progress goes to `say`, the results table to `show`."""
    started = datetime.now(UTC).isoformat(timespec="seconds")
    st = None
    if selftest:
        say("client self-test against the built-in simulator ...")
        st = await self_test(max(plan.levels))
    cells: list[tuple[Cell, dict[str, Any]]] = []
    described: list[dict[str, Any]] = []
    failed: list[RequestError] = []

    def done(cell: Cell) -> None:
        summary = summarize(cell.records, cell.wall_s, cell.repeated)
        cells.append((cell, summary))
        tps = summary["output_throughput"]
        say(
            f"  {cell.endpoint} / {cell.cls} @ {cell.concurrency}: "
            f"{summary['succeeded']}/{summary['requests']} ok, "
            + (f"{tps:,.0f} out tok/s" if tps is not None else "out tok/s unknown")
        )

    setup = _Setup(suite, plan, guided, transport, say, done)
    try:
        for endpoint in endpoints:
            try:
                await _measure(endpoint, setup, described)
            except RequestError as exc:  # one endpoint down: the others are still measured
                say(f"  {endpoint.name}: {exc}")
                shown = shown_endpoint(endpoint.spec.base_url)
                error = {"error": str(exc), "model": endpoint.spec.model}
                described.append({"name": endpoint.name, "base_url": shown, **error})
                failed.append(exc)
    finally:  # what was measured is written, whatever stopped the run (Ctrl-C too)
        results = _results(label, started, plan, suite, guided, st, described, cells)
        if cells or not failed:
            _write(folder, results, say, show)
    if failed:  # said after the files: exit as for that error
        raise failed[0]
    return results


@dataclass(frozen=True)
class _Setup:
    """What every endpoint of one run is measured under, and where it is told."""

    suite: Suite
    plan: LoadPlan
    guided: bool
    transport: Transport | None
    say: Callable[[str], None]  # progress
    done: Callable[[Cell], None]  # each cell as it ends


async def _measure(endpoint: Endpoint, setup: _Setup, described: list[dict[str, Any]]) -> None:
    """One endpoint's sweep, described (as results.json does) before it starts, so that the
    cells of one stopped midway are not left without it."""
    backend = build_backend(endpoint.spec, setup.transport)
    shown = shown_endpoint(endpoint.spec.base_url)
    try:
        listed = [] if endpoint.spec.model else await backend.list_models()
        model = endpoint.spec.model or (listed[0] if listed else None)
        style = preset_for(endpoint.spec).guided_style if setup.guided else None
        p = setup.plan
        run_plan = LoadPlan(p.levels, p.repeat, p.warmup, p.rate, p.seed, model, style)
        described.append({"name": endpoint.name, "base_url": shown, "model": model})
        setup.say(f"benchmarking {endpoint.name} ({shown}, model {model}) ...")
        await sweep(backend, endpoint.name, setup.suite, run_plan, on_cell=setup.done)
    finally:
        await backend.aclose()


def _write(
    folder: Path, results: dict[str, Any], say: Callable[[str], None], show: Callable[[str], None]
) -> None:
    files = report.write_all(folder, results)
    if plots.available():
        files += plots.write_charts(folder, [("", results)])
    else:
        say(plots.MISSING)
    show(report.console(results))
    say(f"wrote {', '.join(p.name for p in files)} to {folder}")


def _results(
    label: str,
    started: str,
    plan: LoadPlan,
    suite: Suite,
    guided: bool,
    st: dict[str, Any] | None,
    endpoints: list[dict[str, Any]],
    cells: list[tuple[Cell, dict[str, Any]]],
) -> dict[str, Any]:
    rows = [
        {
            "endpoint": c.endpoint,
            "class": c.cls,
            "concurrency": c.concurrency,
            "client_bound": client_bound(s, st),
            **s,
        }
        for c, s in cells
    ]
    knees = []
    for endpoint in dict.fromkeys(r["endpoint"] for r in rows):
        for cls in suite.names():
            levels = [
                (
                    r["concurrency"],
                    _throughput(r),
                    r["e2e_ms"]["p95"],
                    r["load_success_rate"] or 0.0,
                )
                for r in rows
                if r["endpoint"] == endpoint and r["class"] == cls
            ]
            if levels:
                knees.append({"endpoint": endpoint, "class": cls, **knee(levels)})
    return {
        "label": label,
        "created": started,
        "finished": datetime.now(UTC).isoformat(timespec="seconds"),
        "settings": {
            "levels": list(plan.levels),
            "repeat": plan.repeat,
            "warmup": plan.warmup,
            "rate": plan.rate,
            "seed": plan.seed,
            "guided": guided,
            "classes": {
                c.name: {
                    "max_tokens": c.max_tokens,
                    "prompts": len(c.prompts),
                    "schema": c.schema is not None,
                }
                for c in suite.classes
            },
        },
        "selftest": st,
        "endpoints": endpoints,
        "cells": rows,
        "knees": knees,
        "requests": [r.to_json() for c, _s in cells for r in c.records],
    }


def _throughput(cell: dict[str, Any]) -> float:
    """What the knee compares: output tokens/s, or requests/s where tokens are unknown."""
    if cell["tokens_unknown"] or cell["output_throughput"] is None:
        return float(cell["request_throughput"] or 0.0)
    return float(cell["output_throughput"])


def output_folder(outputs: Path, label: str) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in label)[:60]
    return outputs / f"bench-{safe}-{stamp}"
