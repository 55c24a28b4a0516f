"""A standalone Spark master that takes no connection, caught in seconds before Spark starts (no
pyspark import): the jobs check it with their other input before the session, the session again
for a master taken from spark-submit's settings."""
from __future__ import annotations

import socket

from freescale.runtime.errors import ServiceUnavailable, one_line


# How long a standalone master gets to take a connection before the job gives up on it.
MASTER_CHECK_TIMEOUT_S = 5.0


def check_master(master: str | None, timeout_s: float = MASTER_CHECK_TIMEOUT_S) -> None:
    """Raise ServiceUnavailable, naming the master, when a standalone master (``spark://HOST:PORT``,
    or several for a standby pair, comma separated) takes no connection at any of its addresses.

    Spark itself would try to register with it 3 times, 20 s apart (fixed in its
    StandaloneAppClient: no setting shortens it), then stop the context, and the job's first call
    would fail with "Cannot call methods on a stopped SparkContext". Other masters (local, yarn,
    k8s) are not checked.
    """
    if not master or not master.startswith("spark://"):
        return
    failures = []
    for address in master[len("spark://"):].split(","):
        reason = _refused(address.strip(), timeout_s)
        if reason is None:
            return
        failures.append(f"{address.strip()}: {reason}")
    raise ServiceUnavailable(f"Spark master {master} does not answer ({'; '.join(failures)}): is it running, "
                             "and is this its URL (spark-submit --master)?")


def _refused(address: str, timeout_s: float) -> str | None:
    """Why ``HOST:PORT`` takes no TCP connection; None when it takes one."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        return "not HOST:PORT"
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return None
    except TimeoutError:
        return f"no answer in {timeout_s:g} s"
    except OSError as exc:
        return exc.strerror or one_line(exc)
