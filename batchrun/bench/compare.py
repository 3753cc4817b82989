"""`batchrun bench compare A B`: two runs side by side, as ratios B / A per matching cell."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from batchrun.errors import UsageError

METRICS = [  # (label, the cell's field, the statistic or None)
    ("out tok/s", "output_throughput", None),
    ("req/s", "request_throughput", None),
    ("TTFT p50", "ttft_ms", "p50"),
    ("TPOT p50", "tpot_ms", "p50"),
    ("E2E p95", "e2e_ms", "p95"),
]


def _read(cell: dict[str, Any], name: str, stat: str | None) -> float | None:
    value = cell[name] if stat is None else cell[name][stat]
    return None if value is None else float(value)


def load(folder: Path) -> dict[str, Any]:
    path = folder / "results.json"
    try:
        data: dict[str, Any] = orjson.loads(path.read_bytes())
    except FileNotFoundError:
        raise UsageError(f"{folder} holds no results.json (is it a bench output folder?)") from None
    except orjson.JSONDecodeError as exc:
        raise UsageError(f"{path} is not valid JSON: {exc}") from None
    return data


def _key(cell: dict[str, Any], single_endpoint: bool) -> tuple[str, str, int]:
    # Runs of one endpoint each are compared across endpoints: the class and level match.
    return ("" if single_endpoint else cell["endpoint"], cell["class"], cell["concurrency"])


def ratios(a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, Any]]:
    """For each cell present in both runs: A's and B's figures and B / A."""
    single = len(a["endpoints"]) == 1 and len(b["endpoints"]) == 1
    cells_b = {_key(c, single): c for c in b["cells"]}
    rows = []
    for cell_a in a["cells"]:
        cell_b = cells_b.get(_key(cell_a, single))
        if cell_b is None:
            continue
        row: dict[str, Any] = {
            "class": cell_a["class"],
            "concurrency": cell_a["concurrency"],
            "a": cell_a["endpoint"],
            "b": cell_b["endpoint"],
            "endpoint": None if single else cell_a["endpoint"],  # matched by its name
        }
        for label, name, stat in METRICS:
            va, vb = _read(cell_a, name, stat), _read(cell_b, name, stat)
            row[label] = (va, vb, vb / va if va and vb is not None else None)
        rows.append(row)
    if not rows:
        raise UsageError("the two runs have no class and concurrency level in common")
    return rows


def render(a_label: str, b_label: str, rows: list[dict[str, Any]]) -> str:
    head = (
        f"B / A  (A = {a_label}, B = {b_label}; tok/s and req/s: above 1 is better for B; "
        f"latencies: below 1 is better for B)"
    )
    names = [m[0] for m in METRICS]
    # Runs of several endpoints match cells by endpoint too: each row says which it is.
    width = max((len(r["endpoint"]) for r in rows if r.get("endpoint")), default=0)
    named = ["endpoint".ljust(width)] if width else []
    lines = [
        head,
        "  ".join([*named, "class".ljust(8), "conc".rjust(4), *(n.rjust(10) for n in names)]),
    ]
    for r in rows:
        cells = ["-".rjust(10) if r[n][2] is None else f"{r[n][2]:.2f}x".rjust(10) for n in names]
        which = [(r.get("endpoint") or "").ljust(width)] if width else []
        lines.append(
            "  ".join([*which, r["class"].ljust(8), str(r["concurrency"]).rjust(4), *cells])
        )
    return "\n".join(lines)
