"""The error types jobs raise on purpose (bad input, a service that does not answer): each is one
line and an exit status (freescale/runtime/job_errors.py). Import-free, so every package downstream (balancing,
shards, training, jobs) can derive its own errors from these."""


class InputError(ValueError):
    """Input that cannot be processed: the message names the file, column or value. The base of the
    packages' bad-input errors (a shard set, a plan the constraints admit none of), so a job ends on
    any of them, or on a subclass it has never heard of, with exit 2."""


class ServiceUnavailable(RuntimeError):
    """A service the job needs does not answer (a Spark master): the environment's fault, not the
    input's; the message names the service and its address."""


def one_line(error: BaseException | str) -> str:
    """An error's message folded onto one line (Arrow, OS and CUDA errors can span several;
    job logs are read one line per failure); the error's type name when it has no message, or
    when asking for it fails (py4j's errors ask the JVM, which may be gone): it never raises."""
    try:
        text = " ".join(str(error).split())
    except Exception:  # noqa: BLE001 - a warning about a failed cleanup must not fail in turn
        text = ""
    if not text and isinstance(error, BaseException):
        return type(error).__name__
    return text
