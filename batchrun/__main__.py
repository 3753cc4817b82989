"""The `batchrun` command's process (`python -m batchrun`, and the installed script)."""

import gc

from batchrun.cli import main

# New container objects between two collections of the youngest generation (Python's
# default: 700).
YOUNG_OBJECTS = 10_000


def entry() -> None:
    """Run the CLI in a process of its own, with the cyclic collector set for a batch job.

    Each request makes and frees hundreds of containers (its JSON), which at the default
    threshold meant a collection every request or two; and the objects made at start (modules,
    classes) live as long as the process, so they are frozen out of every later collection.
    The collector took 0.26-0.33 s of a 5,000-request job, and takes 0.06-0.08 s now, most of
    it while the package is imported, before this runs (benchmarks/gc_cost.py). Only here: a
    program that imports batchrun keeps its own collector settings.
    """
    gc.freeze()
    gc.set_threshold(YOUNG_OBJECTS)
    main()


if __name__ == "__main__":
    entry()
