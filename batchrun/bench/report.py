"""A bench run's files: results.json (everything, per request), summary.csv (one row per cell),
report.md (tables, knees, warnings), and the console table.

results.json shape: {label, created, settings, selftest, endpoints: [{name, base_url, model,
error (only where it could not be measured)}],
cells: [{endpoint, class, concurrency, client_bound, ...metrics.summarize()}],
knees: [{endpoint, class, concurrency, reason}], requests: [RequestRecord...]}.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any

import orjson

CSV_FIELDS = [
    "endpoint",
    "class",
    "concurrency",
    "requests",
    "succeeded",
    "success_rate",
    "request_throughput",
    "output_throughput",
    "ttft_p50_ms",
    "ttft_p95_ms",
    "ttft_p99_ms",
    "ttft_mean_ms",
    "tpot_p50_ms",
    "tpot_p95_ms",
    "tpot_p99_ms",
    "tpot_mean_ms",
    "itl_p50_ms",
    "itl_p95_ms",
    "itl_p99_ms",
    "itl_mean_ms",
    "e2e_p50_ms",
    "e2e_p95_ms",
    "e2e_p99_ms",
    "e2e_mean_ms",
    "schema_valid_rate",
    "errors",
    "client_bound",
    "warnings",
    "tokens_from_chunks",  # the server sent no usage: tokens counted by streamed chunks
    "tokens_unknown",  # nor chunks: output tokens/s left empty
]


def csv_row(cell: dict[str, Any]) -> dict[str, Any]:
    row = {
        k: cell.get(k)
        for k in (
            "endpoint",
            "class",
            "concurrency",
            "requests",
            "succeeded",
            "success_rate",
            "request_throughput",
            "output_throughput",
            "schema_valid_rate",
            "client_bound",
            "tokens_from_chunks",
            "tokens_unknown",
        )
    }
    for metric in ("ttft", "tpot", "itl", "e2e"):
        for stat in ("p50", "p95", "p99", "mean"):
            row[f"{metric}_{stat}_ms"] = cell[f"{metric}_ms"][stat]
    row["errors"] = ";".join(f"{code}:{n}" for code, n in cell["errors"].items())
    row["warnings"] = "; ".join(cell["warnings"])
    return row


def write_all(folder: Path, results: dict[str, Any]) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    json_path = folder / "results.json"
    json_path.write_bytes(orjson.dumps(results, option=orjson.OPT_INDENT_2))
    csv_path = folder / "summary.csv"
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=CSV_FIELDS)
    writer.writeheader()
    for cell in results["cells"]:
        writer.writerow(csv_row(cell))
    csv_path.write_text(buffer.getvalue())
    md_path = folder / "report.md"
    md_path.write_text(markdown(results))
    return [json_path, csv_path, md_path]


def _num(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def table(cells: list[dict[str, Any]]) -> list[list[str]]:
    """Rows for the console and report.md: the figures a serving engineer reads first."""
    head = [
        "endpoint",
        "class",
        "conc",
        "req/s",
        "out tok/s",
        "TTFT p50",
        "TTFT p95",
        "TPOT p50",
        "ITL p95",
        "E2E p50",
        "E2E p95",
        "E2E p99",
        "ok",
        "schema",
        "note",
    ]
    rows = [head]
    for c in cells:
        note = []
        if c.get("client_bound"):
            note.append("client-bound?")
        if c["warnings"]:
            note.append("few samples")
        if c.get("tokens_from_chunks"):
            note.append("tokens=chunks")
        if c.get("tokens_unknown"):
            note.append("tokens unknown")
        rows.append(
            [
                c["endpoint"],
                c["class"],
                str(c["concurrency"]),
                _num(c["request_throughput"], 2),
                _num(c["output_throughput"]),
                _num(c["ttft_ms"]["p50"]),
                _num(c["ttft_ms"]["p95"]),
                _num(c["tpot_ms"]["p50"], 1),
                _num(c["itl_ms"]["p95"], 1),
                _num(c["e2e_ms"]["p50"]),
                _num(c["e2e_ms"]["p95"]),
                _num(c["e2e_ms"]["p99"]),
                f"{c['success_rate']:.0%}" if c["success_rate"] is not None else "-",
                "-" if c["schema_valid_rate"] is None else f"{c['schema_valid_rate']:.0%}",
                ", ".join(note),
            ]
        )
    return rows


def console(results: dict[str, Any]) -> str:
    rows = table(results["cells"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(
            v.rjust(w) if i > 2 else v.ljust(w)
            for i, (v, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in rows
    ]
    lines.append("")
    for k in results["knees"]:
        lines.append(
            f"recommended concurrency for {k['endpoint']} / {k['class']}: "
            f"{k['concurrency']} ({k['reason']})"
        )
    lines.extend(_warnings(results))
    return "\n".join(lines)


def _warnings(results: dict[str, Any]) -> list[str]:
    out = []
    st = results.get("selftest")
    if st:
        out.append(
            f"client self-test: this process drove {st['request_throughput']:,.0f} req/s "
            f"and {st['chunk_rate']:,.0f} streamed chunks/s against the built-in "
            f"simulator; cells above half of that are marked client-bound?"
        )
    seen = set()
    for c in results["cells"]:
        for w in c["warnings"]:
            if w not in seen:
                seen.add(w)
                out.append(f"warning: {w} (cells marked 'few samples'; raise --repeat)")
    if any(c.get("tokens_from_chunks") for c in results["cells"]):
        out.append("note: some servers sent no usage; their token counts are streamed chunks")
    return out


def markdown(results: dict[str, Any]) -> str:
    rows = table(results["cells"])
    s = results["settings"]
    lines = [
        f"# batchrun bench: {results['label']}",
        "",
        f"Run {results['created']}; concurrency {s['levels']}, "
        f"{'Poisson arrivals at ' + str(s['rate']) + ' req/s, ' if s['rate'] else ''}"
        f"{s['repeat']} requests per class per level (at least one per slot), "
        f"{s['warmup']} warm-up, seed {s['seed']}, temperature 0.2, top_p 0.9.",
        "",
        "| " + " | ".join(rows[0]) + " |",
        "|" + "---|" * len(rows[0]),
    ]
    lines += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    lines += ["", "## Recommended concurrency (knee)", ""]
    lines += [
        f"- {k['endpoint']} / {k['class']}: **{k['concurrency']}**, {k['reason']}"
        for k in results["knees"]
    ]
    lines += ["", "## Endpoints", ""]
    lines += [
        f"- {e['name']}: {e['base_url']} "
        + (f"not measured: {e['error']}" if e.get("error") else f"model {e['model']}")
        for e in results["endpoints"]
    ]
    notes = _warnings(results)
    if notes:
        lines += ["", "## Notes", "", *(f"- {n}" for n in notes)]
    lines += [
        "",
        "Definitions: TTFT = time to the first non-empty content delta; TPOT = (E2E - "
        "TTFT) / (output tokens - 1); ITL = gaps between streamed content deltas; E2E = "
        "send to last byte. Percentiles are nearest-rank.",
        "",
    ]
    return "\n".join(lines)
