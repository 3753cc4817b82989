"""How the CLI reports: one line on stderr, and the exit code the README gives each error."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click

from batchrun.errors import BatchrunError, FatalError
from batchrun.jobs import EXIT_ABORTED, EXIT_INTERRUPTED, EXIT_USAGE

F = TypeVar("F", bound=Callable[..., Any])


def say(message: str) -> None:
    click.echo(f"batchrun: {message}", err=True)


def errors_to_exit_codes(fn: F) -> F:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except FatalError as exc:
            say(f"aborted: {exc}")
            sys.exit(EXIT_ABORTED)
        except BatchrunError as exc:
            say(f"error: {exc}")
            sys.exit(EXIT_USAGE)
        except KeyboardInterrupt:
            say("interrupted")
            sys.exit(EXIT_INTERRUPTED)

    return wrapper  # type: ignore[return-value]
