"""How every job ends on bad input: one line on stderr naming the problem, exit status 2."""
from __future__ import annotations

import os
import sys
from typing import Callable

from pipeline.errors import InputError

EXIT_BAD_INPUT = 2


# Error classes that end a job with one line, by the module that defines them. A class
# can only have been raised if its module is loaded, so only loaded modules are asked:
# reporting a bad argument never imports torch, torchrec or pyspark just to name a class.
_EXPECTED = (("balancing.types", "InfeasibleError"), ("training.config", "ConfigError"),
             ("shards.manifest", "ShardError"), ("comm.errors", "BackendUnavailable"),
             ("pyspark.errors", "PySparkException"))


def _expected_errors() -> tuple[type[BaseException], ...]:
    expected: list[type[BaseException]] = [InputError, FileExistsError, FileNotFoundError]
    for module, name in _EXPECTED:
        if module in sys.modules:
            expected.append(getattr(sys.modules[module], name))
    return tuple(expected)


def first_line(exc: BaseException) -> str:
    """The message's first line; for an error raised inside a Spark task, the original error's line."""
    text = str(exc).strip()
    lines = text.splitlines()
    for marker in ("InfeasibleError: ", "InputError: ", "ShardError: "):
        raised = [line for line in lines if marker in line]
        if raised:
            return raised[-1].split(marker, 1)[1].strip()
    return lines[0] if lines else type(exc).__name__


def run_job(job: str, body: Callable[[], int | None]) -> int:
    """Run `body`; expected failures become one line, everything else keeps its traceback.

    FREESCALE_DEBUG=1 shows the traceback of expected failures too.
    """
    try:
        return body() or 0
    except _expected_errors() as exc:
        if os.environ.get("FREESCALE_DEBUG"):
            raise
        # One write, newline included: ranks share the launcher's stderr, and print()'s
        # separate write of the newline let two ranks' lines run together.
        sys.stderr.write(f"freescale {job}: error: {first_line(exc)}\n")
        sys.stderr.flush()
        return EXIT_BAD_INPUT
