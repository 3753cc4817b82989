"""The `batchrun` command's process sets the cyclic collector for a batch job; a program that
imports batchrun keeps its own settings."""

from __future__ import annotations

import subprocess
import sys

from batchrun.__main__ import YOUNG_OBJECTS


def python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return done.stdout.split()[-1]


def test_the_command_freezes_what_start_made_and_collects_less_often() -> None:
    code = (
        "import atexit, gc, sys\n"
        "atexit.register(lambda: print(f'{gc.get_threshold()[0]},{gc.get_freeze_count() > 0}'))\n"
        "sys.argv = ['batchrun', '--version']\n"
        "from batchrun.__main__ import entry\n"
        "entry()\n"
    )
    assert python(code) == f"{YOUNG_OBJECTS},True"


def test_importing_batchrun_leaves_the_collector_alone() -> None:
    code = (
        "import gc\n"
        "before = gc.get_threshold()\n"
        "import batchrun, batchrun.cli, batchrun.__main__\n"
        "print(f'{gc.get_threshold() == before},{gc.get_freeze_count()}')\n"
    )
    assert python(code) == "True,0"
