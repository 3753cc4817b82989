"""How the CLI reports: one line on stderr, and the exit code the README gives each error.

Whatever it prints may hold text from outside (a server's error message, a line of input), so
control characters are shown escaped, never sent raw: a server must not be able to retitle the
user's terminal, colour it, or hide a FAIL line behind a carriage return.
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click

from batchrun.errors import BatchrunError, FatalError, LedgerError, OptionError

F = TypeVar("F", bound=Callable[..., Any])

EXIT_OK, EXIT_SOME_FAILED, EXIT_USAGE, EXIT_ABORTED, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


# C0 controls but newline and tab, DEL, C1 controls (U+009B alone starts an escape sequence),
# and the characters that reorder or break lines unseen (bidi controls, line/paragraph separators).
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """`text` with control characters written as JSON-style escapes (`\\u001b`), so the
    JSON that `--json` prints stays valid JSON with the same values."""
    return _CONTROL.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def say(message: str) -> None:
    click.echo(f"batchrun: {printable(message)}", err=True)


def show(text: str) -> None:
    """What a command prints on stdout (tables, reports)."""
    click.echo(printable(text))


def flag(key: str) -> str:
    """The command-line flag of a run option's key: max_attempts is --max-attempts."""
    return "--" + key.replace("_", "-")


def errors_to_exit_codes(fn: F) -> F:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except FatalError as exc:
            say(f"aborted: {exc}")
            sys.exit(EXIT_ABORTED)
        except OptionError as exc:  # named by the flags that set them
            say(f"error: {exc.naming(flag)}")
            sys.exit(EXIT_USAGE)
        except LedgerError as exc:  # a database server out of reach: try again later
            say(f"{'aborted' if exc.out_of_reach else 'error'}: {exc}")
            sys.exit(EXIT_ABORTED if exc.out_of_reach else EXIT_USAGE)
        except BatchrunError as exc:
            say(f"error: {exc}")
            sys.exit(EXIT_USAGE)
        except KeyboardInterrupt:
            say("interrupted")
            sys.exit(EXIT_INTERRUPTED)

    return wrapper  # type: ignore[return-value]
