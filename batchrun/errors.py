"""batchrun's error types.

Errors are classified once, at the boundary where they happen (the backend for HTTP, the reader
for input, the ledger for storage), so the runner and the CLI only ever branch on these types:
Transient errors are retried, Permanent ones fail one item, Fatal ones stop the whole job.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any


class BatchrunError(Exception):
    """Root of every error batchrun raises on purpose."""

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as it is, not by calling its class again with its message (an InputError
        takes its problems, a JobAborted its report): so it crosses a process pool's boundary
        (multiprocessing, joblib, Dask) as raised."""
        return (_restored, (type(self), self.args, self.__dict__))


def _restored(cls: type[BatchrunError], args: tuple[Any, ...], state: dict[str, Any]) -> Any:
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


# --- request outcomes -------------------------------------------------------------------------


class RequestError(BatchrunError):
    """A request to the endpoint did not produce a usable completion."""

    asked_again: tuple[str, ...] = ()  # as Completion.asked_again: the asks before this one

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class TransientError(RequestError):
    """Worth retrying: the same request may succeed later."""

    retry_after: float | None = None


class RateLimited(TransientError):
    """429: the server asked us to slow down, possibly saying for how long.

    `budget_spent`: its `x-ratelimit-remaining-*` said a whole budget is used up, so every
    request would be refused until it refills (not just this one)."""

    def __init__(
        self,
        message: str,
        *,
        status: int | None = 429,
        retry_after: float | None = None,
        budget_spent: bool = False,
    ) -> None:
        super().__init__(message, status=status)
        self.retry_after = retry_after
        self.budget_spent = budget_spent


class Overloaded(TransientError):
    """5xx, 408 or 409: the server failed this time."""

    def __init__(
        self, message: str, *, status: int | None = None, retry_after: float | None = None
    ) -> None:
        super().__init__(message, status=status)
        self.retry_after = retry_after


class RequestTimeout(TransientError):
    """No complete answer within --timeout."""


class ConnectionFailed(TransientError):
    """The endpoint could not be reached or dropped the connection."""


class StreamCut(TransientError):
    """A streamed answer ended before its final chunk, or a 200 carried no usable body."""


class EmptyStream(StreamCut):
    """A 200 event stream that closed without a single event: llama-cpp-python's answer to a
    prompt it cannot take (the reason goes only to its own log)."""


class PermanentError(RequestError):
    """Retrying the same request cannot help; the item fails at once."""


class BadRequest(PermanentError):
    """400/413/422: the server refused this request (e.g. prompt longer than the context)."""


class FatalError(RequestError):
    """The configuration is wrong; every other item would fail the same way, so the job stops."""


class AuthFailed(FatalError):
    """401/403: missing or wrong API key."""


class NotFound(FatalError):
    """404: unknown model or wrong base URL/path."""


class EndpointDown(FatalError):
    """The endpoint stayed unreachable for longer than the outage grace period."""


# --- local problems -----------------------------------------------------------------------------


class UsageError(BatchrunError):
    """A problem with how batchrun was invoked or configured (exit code 2)."""


class OptionError(UsageError):
    """A run option is wrong. The message names options as `{key}`: said by the library as the
    key (`max_attempts`, as the API and spec files take it), by the CLI as its flag."""

    def __init__(self, template: str) -> None:
        self.template = template
        super().__init__(self.naming(lambda key: key))

    def naming(self, name: Callable[[str], str]) -> str:
        """The message with each `{key}` written as `name(key)` (and a value's own braces,
        doubled by `quoted`, put back as they were)."""
        text = re.sub(r"(?<!\{)\{([a-z_]+)\}(?!\})", lambda m: name(m.group(1)), self.template)
        return text.replace("{{", "{").replace("}}", "}")

    @staticmethod
    def quoted(value: object) -> str:
        """repr(value) for a message, its braces doubled so none reads as an option's name."""
        return repr(value).replace("{", "{{").replace("}", "}}")


class InputError(BatchrunError):
    """The input file has bad lines; carries every problem found, by line number."""

    def __init__(self, problems: list[tuple[int, str]], *, path: str = "") -> None:
        self.problems = problems
        self.path = path
        shown = "\n".join(f"  line {line}: {reason}" for line, reason in problems[:50])
        more = f"\n  ... and {len(problems) - 50} more" if len(problems) > 50 else ""
        where = f"{path}: " if path else ""
        super().__init__(f"{where}{len(problems)} bad line(s), nothing was sent:\n{shown}{more}")


class EmptyInput(InputError):
    """The input file holds no item at all (empty, or only blank lines)."""

    def __init__(self, message: str) -> None:
        self.problems, self.path = [], ""
        BatchrunError.__init__(self, message)


class LedgerError(BatchrunError):
    """The ledger could not be opened, read or written (disk full, read-only, corrupt), or
    refused a change that would break its rules (the subclasses below)."""

    def __init__(self, message: str, *, busy: bool = False, out_of_reach: bool = False) -> None:
        super().__init__(message)
        self.busy = busy  # another process held the lock past the busy timeout
        self.out_of_reach = out_of_reach  # the database server is restarting or unreachable


class JobExists(LedgerError):
    """A job of that name is already in the ledger (another submit may have just made it)."""


class OutputError(BatchrunError):
    """The results file could not be written; any earlier results file is left untouched."""


def single_error(group: BaseExceptionGroup) -> BaseException:
    """Task groups wrap errors; hand the caller the batchrun error inside, if there is one,
    so it gets its message and exit code instead of a traceback."""
    leaves: list[BaseException] = []
    stack: list[BaseException] = [group]
    while stack:
        exc = stack.pop()
        if isinstance(exc, BaseExceptionGroup):
            stack.extend(exc.exceptions)
        else:
            leaves.append(exc)
    ours = [e for e in leaves if isinstance(e, BatchrunError)]
    if ours:
        return ours[0]
    return leaves[0] if len(leaves) == 1 else group  # one error (a callback's, say): as raised
