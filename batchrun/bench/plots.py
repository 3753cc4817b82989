"""PNG charts of a bench run, and of two runs overlaid. matplotlib is the optional `plot` extra:
without it the other files are still written and this says how to get the charts."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

Runs = list[tuple[str, dict[str, Any]]]  # (label, results) per run; two when comparing
MISSING = "charts skipped: matplotlib is not installed (pip install 'batchrun[plot]')"


def available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _series(results: dict[str, Any], metric: str) -> dict[str, tuple[list[int], list[float]]]:
    """(concurrency levels, values) per endpoint/class line."""
    lines: dict[str, tuple[list[int], list[float]]] = {}
    for cell in sorted(results["cells"], key=lambda c: c["concurrency"]):
        value = cell["output_throughput"] if metric == "throughput" else cell["e2e_ms"]["p95"]
        if value is None:
            continue
        xs, ys = lines.setdefault(f"{cell['endpoint']} / {cell['class']}", ([], []))
        xs.append(cell["concurrency"])
        ys.append(value)
    return lines


def _line_chart(runs: Runs, metric: str, ylabel: str, path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    for style, (label, results) in zip(["-", "--"], runs, strict=False):
        for name, (xs, ys) in _series(results, metric).items():
            ax.plot(xs, ys, style, marker="o", label=f"{label}: {name}" if label else name)
    levels = sorted({c["concurrency"] for _label, results in runs for c in results["cells"]})
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(level) for level in levels])
    ax.minorticks_off()
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel(ylabel)
    ax.set_title(f"{ylabel} by concurrency, per endpoint and prompt class")
    return _save(plt, fig, ax, path)


def _ttft_chart(runs: Runs, path: Path) -> Path:
    """TTFT distribution: an empirical CDF per endpoint and concurrency, all classes."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    for style, (label, results) in zip(["-", "--"], runs, strict=False):
        groups: dict[str, list[float]] = {}
        for r in results["requests"]:
            if r["ok"] and r["ttft_ms"] is not None:
                groups.setdefault(f"{r['endpoint']} c={r['concurrency']}", []).append(r["ttft_ms"])
        for name, values in sorted(groups.items()):
            values.sort()
            ys = [(i + 1) / len(values) for i in range(len(values))]
            ax.step(values, ys, style, where="post", label=f"{label}: {name}" if label else name)
    ax.set_xlabel("time to first token (ms)")
    ax.set_ylabel("share of requests")
    ax.set_title("time to first token, CDF per endpoint and concurrency (all classes pooled)")
    return _save(plt, fig, ax, path)


def _save(plt: Any, fig: Any, ax: Any, path: Path) -> Path:
    """Axes from 0 (a chart that starts elsewhere exaggerates differences), a grid, a legend
    when something was drawn (a level where every request failed draws nothing)."""
    ax.set_ylim(bottom=0)
    if ax.get_xscale() == "linear":
        ax.set_xlim(left=0)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_charts(folder: Path, runs: Runs) -> list[Path]:
    """Throughput and P95 latency against concurrency, and the TTFT distribution."""
    return [
        _line_chart(runs, "throughput", "output tokens/s", folder / "throughput.png"),
        _line_chart(runs, "p95", "P95 end-to-end latency (ms)", folder / "latency_p95.png"),
        _ttft_chart(runs, folder / "ttft_cdf.png"),
    ]
