"""Would compiling batchrun's stream reader, as it is, bring streamed within 0.9 of not streamed?

mypyc (it comes with mypy, a dev dependency; it needs a C compiler and Python's headers)
compiles the reader's modules (backends/sse.py, frames.py, answers.py) into a copy of the
package: the same source as native code, so nothing new to trust. Then client_cost.py's two
batchrun jobs, streamed and not, run on the copy and on this checkout in turns (the copy first
every other round), and each run's own streamed / not streamed line is printed: each ratio is
taken within its run, so the two trees compare though the machine drifts between them.

    python benchmarks/compiled_reader.py [--rounds 2] [--requests 5000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from client_cost import CHILD_ENV

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
READER = ["batchrun/backends/sse.py", "batchrun/backends/frames.py", "batchrun/backends/answers.py"]
GOAL_LINE = "batchrun streamed / not streamed"


def compiled_copy(into: Path) -> Path:
    """A copy of the package with the reader's modules compiled (no pyproject beside it:
    mypyc's setup reads none)."""
    shutil.copytree(ROOT / "batchrun", into / "batchrun", ignore=_not_source)
    done = subprocess.run([sys.executable, "-m", "mypyc", *READER], cwd=into, capture_output=True)
    if done.returncode:  # no C compiler, no Python headers, mypy missing: its own words
        raise SystemExit(f"mypyc failed:\n{(done.stdout + done.stderr).decode()[-3000:]}")
    check = "import batchrun.backends.frames as m; print(m.__file__)"
    where = _python(into, ["-c", check]).strip()
    if not where.endswith(".so"):
        raise SystemExit(f"the copy's reader is not compiled: {where}")
    return into


def _not_source(folder: str, names: list[str]) -> set[str]:
    return {name for name in names if name == "__pycache__" or name.endswith(".so")}


def goal_line(tree: Path, args: argparse.Namespace) -> str:
    """client_cost.py's streamed / not streamed line, batchrun loaded from `tree`."""
    command = [str(HERE / "client_cost.py"), "--only", "batchrun,batchrun-stream"]
    command += ["--requests", str(args.requests), "--repeat", str(args.repeat)]
    out = _python(tree, command)
    return next(line for line in out.splitlines() if line.startswith(GOAL_LINE))


def _python(tree: Path, command: list[str]) -> str:
    env = {**CHILD_ENV, "PYTHONPATH": os.pathsep.join([str(tree), str(HERE)])}
    done = subprocess.run([sys.executable, *command], env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
    return done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"compiled": compiled_copy(Path(tmp)), "source": ROOT}
        print(f"the reader compiled by mypyc ({', '.join(READER)}) against this checkout")
        for round_ in range(args.rounds):
            order = list(trees) if round_ % 2 == 0 else list(reversed(trees))
            for name in order:
                print(f"round {round_ + 1} {name:8}  {goal_line(trees[name], args)}", flush=True)


if __name__ == "__main__":
    main()
