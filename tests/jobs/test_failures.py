"""Every job fails the same way: one line last (naming the log when it holds a trace), no trace on
the terminal unless --verbose, and one exit status per kind of failure (freescale/runtime/job_errors.py)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from freescale.runtime import job_errors
from freescale.runtime.job_errors import EXIT_BAD_INPUT, EXIT_ENVIRONMENT, EXIT_FAILED
from freescale.runtime import logs

REPO = Path(__file__).resolve().parents[2]
DETAILS = re.compile(r" \(details: (.+\.log)\)$")
TRACE_MARKERS = ("Traceback", "ChildFailedError", "\tat ", "File \"", "Exception in task")


def freescale(*args: str, logs_dir: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in (logs.LOG_FILE_ENV, logs.VERBOSE_ENV, logs.DEBUG_ENV)}
    env.update({logs.LOG_DIR_ENV: str(logs_dir), "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"})
    return subprocess.run([sys.executable, "-m", "freescale.jobs.cli", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def terminal_lines(run: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (run.stdout + run.stderr).splitlines() if line.strip()]


def logged(line: str, logs_dir: Path) -> str:
    """The text of the log that `line` names (which lies in logs_dir)."""
    named = DETAILS.search(line)
    assert named, line
    path = Path(named.group(1))
    path = path if path.is_absolute() else REPO / path
    assert path.parent.resolve() == logs_dir.resolve(), path
    return path.read_text()


# ------------------------------------------------------------------ exit codes, in process


def test_exit_codes_by_kind():
    from freescale.balancing.types import InfeasibleError
    from freescale.comm.errors import BackendUnavailable
    from freescale.runtime.errors import InputError
    from pyspark.errors import AnalysisException, PySparkRuntimeError
    from freescale.shards.manifest import ShardError
    from freescale.training.config import ConfigError

    for bad in (InputError("x"), ConfigError("x"), ShardError("x"), InfeasibleError("x"),
                FileNotFoundError("x"), FileExistsError("x"), AnalysisException("x")):
        assert job_errors.exit_code(bad) == EXIT_BAD_INPUT, bad
    gateway = PySparkRuntimeError(errorClass="JAVA_GATEWAY_EXITED", messageParameters={})
    for environment in (BackendUnavailable("comm.backend nccl needs CUDA"), gateway):
        assert job_errors.exit_code(environment) == EXIT_ENVIRONMENT, environment
    for other in (RuntimeError("x"), KeyError("x"), ZeroDivisionError()):
        assert job_errors.exit_code(other) == EXIT_FAILED, other


def test_bad_input_errors_share_one_base_that_the_exit_code_reads():
    from freescale.balancing.types import InfeasibleError
    from freescale.runtime.errors import InputError
    from freescale.shards.manifest import ShardError
    from freescale.training.config import ConfigError

    assert all(issubclass(error, InputError) for error in (InfeasibleError, ShardError, ConfigError))
    assert job_errors.exit_code(ConfigError("training.precision: 'fp8' is not one of ...")) == EXIT_BAD_INPUT

    class NewBadInput(InputError):  # a package's own error, named nowhere in job_errors
        pass

    assert job_errors.exit_code(NewBadInput("x")) == EXIT_BAD_INPUT


def test_a_spark_read_error_is_bad_input_named_in_one_line():
    class Py4JJavaError(Exception):  # py4j's, as its text reads: the JVM's trace under one line
        pass

    text = ("An error occurred while calling o165.localCheckpoint.\n"
            ": org.apache.spark.SparkException: [FAILED_READ_FILE.NO_HINT] Encountered error while reading file "
            "file:///data/part-0.parquet.  SQLSTATE: KD001\n\tat org.apache.spark.sql.errors.X(X.scala:1)\n"
            "Caused by: org.apache.hadoop.fs.ChecksumException: Checksum error: file:/data/part-0.parquet at 0\n"
            "\tat org.apache.hadoop.fs.Y(Y.java:2)\n")
    error = Py4JJavaError(text)
    assert job_errors.exit_code(error) == EXIT_BAD_INPUT
    assert job_errors.first_line(error) == ("Spark: [FAILED_READ_FILE.NO_HINT] Encountered error while reading "
                                            "file file:///data/part-0.parquet. (ChecksumException: Checksum error: "
                                            "file:/data/part-0.parquet at 0)")
    crash = Py4JJavaError("An error occurred while calling o1.collect.\n: java.lang.OutOfMemoryError: Java heap space\n")
    assert job_errors.exit_code(crash) == EXIT_FAILED
    assert job_errors.first_line(crash) == "java.lang.OutOfMemoryError: Java heap space"


def _boom() -> int:
    raise RuntimeError("boom\nsecond line")


def test_an_unexpected_error_is_one_line_naming_the_log(fresh_log, capsys):
    assert job_errors.run_job("balance", _boom) == EXIT_FAILED
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    line = err.strip()
    assert line.startswith("freescale balance: error: RuntimeError: boom (details: "), line
    text = logged(line, fresh_log)
    assert "Traceback (most recent call last)" in text and "_boom" in text and "second line" in text


def test_verbose_puts_the_traceback_on_the_terminal_and_the_line_last(fresh_log, capsys):
    logs.set_verbose()
    assert job_errors.run_job("balance", _boom) == EXIT_FAILED
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] == "Traceback (most recent call last):" and any("_boom" in line for line in err)
    assert err[-1] == "freescale balance: error: RuntimeError: boom"
    assert not fresh_log.exists()


def test_debug_reraises_expected_errors(fresh_log, monkeypatch):
    from freescale.runtime.errors import InputError

    monkeypatch.setenv(logs.DEBUG_ENV, "1")

    def bad_input() -> int:
        raise InputError("bad")

    with pytest.raises(InputError):
        job_errors.run_job("balance", bad_input)


def test_an_expected_error_without_details_names_no_log(fresh_log, capsys):
    from freescale.jobs import cli

    # --verbose is every subcommand's flag: cli takes it off before the job's parser.
    rc = cli.main(["balance", "--input", "in", "--output", "out", "--world-size", "0", "--local-batch-size", "4"])
    err = capsys.readouterr().err.strip()
    assert rc == EXIT_BAD_INPUT and err == "freescale balance: error: --world-size must be a positive integer, got 0"
    rc = cli.main(["balance", "--verbose", "--input", "in", "--output", "out", "--world-size", "0",
                   "--local-batch-size", "4"])
    assert rc == EXIT_BAD_INPUT and capsys.readouterr().err.strip() == err
    assert not fresh_log.exists()


# ------------------------------------------------------------------ max steps


@pytest.mark.parametrize("value", ["0", "-3"])
def test_max_steps_must_be_positive_before_torchrun_starts(fresh_log, tmp_path, capsys, value):
    from freescale.jobs.launch import launch

    assert launch(["--shards", str(tmp_path), "--nproc-per-node", "2", "--max-steps", value]) == EXIT_BAD_INPUT
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (f"freescale train: error: --max-steps must be a positive integer (omit it for one "
                            f"pass over the shards), got {value}\n")
    assert not fresh_log.exists()  # no rank ever started


def test_config_max_steps_must_not_be_negative(fresh_log, tmp_path, capsys):
    from freescale.jobs.launch import launch
    from freescale.training.config import ConfigError, load_config

    assert load_config(None, ["--training.max_steps", "0"]).training.max_steps == 0  # 0 = one pass
    with pytest.raises(ConfigError, match=r"^command line: training: max_steps must be >= 0 .*got -3$"):
        load_config(None, ["--training.max_steps", "-3"])
    config = tmp_path / "c.toml"
    config.write_text("[training]\nmax_steps = -1\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(config))}: training: max_steps must be >= 0"):
        load_config(config)
    # The launcher checks the ranks' config first: one line, no torchrun.
    assert launch(["--shards", str(tmp_path), "--training.max_steps", "-3"]) == EXIT_BAD_INPUT
    assert capsys.readouterr().err == ("freescale train: error: command line: training: max_steps must be >= 0 "
                                       "(0 = one pass over the shards), got -3\n")


# ------------------------------------------------------------------ training ranks


@pytest.mark.slow
@pytest.mark.parametrize("verbose", [False, True])
def test_a_training_failure_is_one_line_naming_the_ranks_and_the_log(failed_launches, verbose):
    """The session's failing launches: under --verbose no manifest.json on either rank; without it
    a corrupt Parquet file on rank 1, which stops rank 0 too."""
    run = failed_launches.no_manifest if verbose else failed_launches.corrupt
    assert run.returncode == EXIT_BAD_INPUT, run.stderr[-3000:]
    lines = terminal_lines(run)
    last = lines[-1]
    if verbose:  # each rank's line, the ranks' and torchrun's output as it comes, then a last line
        assert last.startswith("freescale train: error: ranks 0, 1 of 2 failed"), lines
        ranks = sorted(line[:25] for line in lines if line.startswith("freescale train (rank"))
        assert ranks == ["freescale train (rank 0):", "freescale train (rank 1):"], lines
        assert "ChildFailedError" in run.stderr and not DETAILS.search(last)
        return
    # nothing else on the terminal but the progress lines: the ranks' reasons, gathered in one line
    errors = [line for line in lines if "error" in line.lower() or "Error" in line]
    assert errors == [last], lines
    assert last.startswith("freescale train: error: ") and failed_launches.victim.name in last, last
    assert "(details: " in last, last
    assert not any(marker in run.stdout + run.stderr for marker in TRACE_MARKERS)
    text = logged(last, failed_launches.corrupt_logs)
    assert "ChildFailedError" in text and "Traceback" in text
    assert "freescale train (rank 1): error: " in text  # each rank's own line, in the log


def test_a_comm_backend_this_machine_lacks_exits_3(movielens_shards_1):
    """One rank, in process: an environment problem is exit 3, its line naming the backend."""
    import io
    from contextlib import redirect_stderr

    import torch

    from tests.helpers import in_process_args, train_in_process

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    err = io.StringIO()
    with redirect_stderr(err):
        rc = train_in_process(*in_process_args(movielens_shards_1, "--training.max_steps", "1",
                                               "--comm.backend", "nccl"))
    assert rc == EXIT_ENVIRONMENT, err.getvalue()[-3000:]
    lines = [line for line in err.getvalue().splitlines() if "error:" in line]
    assert len(lines) == 1 and "comm.backend nccl needs CUDA" in lines[0], lines
    assert not any(marker in err.getvalue() for marker in TRACE_MARKERS)


# ------------------------------------------------------------------ Spark


def corrupt_sequences(prepared: Path, into: Path) -> Path:
    """A copy of a prepare output whose sequence files keep their Parquet footers (so checks that read
    footers pass) but not their data: Spark fails reading them, in a task."""
    shutil.copytree(prepared, into)
    for path in (into / "sequences").glob("*.parquet"):
        data = bytearray(path.read_bytes())
        for i in range(4, int(len(data) * 0.6)):
            data[i] = (i * 37) & 0xFF
        path.write_bytes(bytes(data))
    return into


@pytest.mark.slow
def test_a_spark_read_error_is_one_line_with_the_jvm_trace_in_the_log(movielens_prepared, tmp_path):
    source = corrupt_sequences(movielens_prepared, tmp_path / "corrupt")
    run = freescale("balance", "--input", str(source), "--output", str(tmp_path / "out"), "--world-size", "2",
                    "--local-batch-size", "16", "--tracking-uri", "none", logs_dir=tmp_path / "logs")
    lines = terminal_lines(run)
    assert run.returncode == EXIT_BAD_INPUT, lines
    assert len(lines) == 1 and lines[0].startswith("freescale balance: error: "), lines
    assert "part-" in lines[0]  # names the file
    text = logged(lines[0], tmp_path / "logs")
    assert "\tat org.apache.spark" in text and "FAILED_READ_FILE" in text


@pytest.mark.slow
@pytest.mark.parametrize("verbose", [False, pytest.param(True, marks=pytest.mark.extended)])
def test_an_infeasible_token_cap_is_one_line(movielens_prepared, tmp_path, verbose):
    run = freescale("balance", "--input", str(movielens_prepared), "--output", str(tmp_path / "out"),
                    "--world-size", "2", "--local-batch-size", "16", "--token-cap", "800", "--tracking-uri", "none",
                    *(["--verbose"] if verbose else []), logs_dir=tmp_path / "logs")
    lines = terminal_lines(run)
    assert run.returncode == EXIT_BAD_INPUT, lines
    assert lines[-1].startswith("freescale balance: error: token_cap=800 x world_size=2"), lines
    if verbose:  # Spark's output stays on the terminal, the task's Python trace included
        assert "InfeasibleError" in run.stderr and len(lines) > 1 and not DETAILS.search(lines[-1])
        return
    assert len(lines) == 1, lines
    text = logged(lines[0], tmp_path / "logs")
    assert "InfeasibleError" in text and "Traceback" in text
