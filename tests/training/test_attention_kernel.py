"""The attention kernel a config gets on this machine, refused before torchrun where the ranks would refuse it:
triton on a CPU machine, or triton with a bucket table past its limits (which the grouped path takes)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import triton  # noqa: F401 -- imported under conftest.py's TRITON_INTERPRET, before a test here unsets it

from freescale.runtime.errors import InputError
from freescale.training.model import attention_kernel
from freescale.training.model.attention_kernel import attention_kernel_for, check_attention_kernel, rank_device_type
from freescale.training.config import ConfigError, load_config
from freescale.training.ops import kernel_limits
from freescale.training.ops.kernel_limits import INT32_MAX, POSITION_TABLE_LIMIT

REPO = Path(__file__).resolve().parents[2]
WIDE_GAP = ["--model.hstu.max_time_gap_seconds", "3e9"]  # 95 years: past the kernel's 32-bit gaps
LONG_HISTORY = ["--model.hstu.max_seq_len", str(2 * POSITION_TABLE_LIMIT)]
SOFTMAX = ["--model.hstu.attention_activation", "softmax"]  # the grouped kernel's only


@pytest.fixture
def no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU machine (whatever this one is), triton not interpreted."""
    monkeypatch.setattr(attention_kernel, "GPU_DRIVER_PATHS", ("/nonexistent/nvidiactl",))
    monkeypatch.setattr(attention_kernel.sys, "platform", "linux")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.mark.parametrize("num_buckets,distance,fits", [
    (64, POSITION_TABLE_LIMIT, POSITION_TABLE_LIMIT),  # its last threshold is 2^20 + 1: past
    (64, POSITION_TABLE_LIMIT - 1, POSITION_TABLE_LIMIT),
    (64, 1_000_000, POSITION_TABLE_LIMIT), (64, 3_000_000, POSITION_TABLE_LIMIT),
    (64, 2**31 - 700, INT32_MAX - 1), (64, 2**31, INT32_MAX - 1), (2, 2**31 + 5, INT32_MAX - 1),
    (64, 1e9, INT32_MAX - 1), (64, 3e9, INT32_MAX - 1), (1, 3e9, INT32_MAX - 1),
])
def test_the_limits_agree_with_the_thresholds_the_kernel_builds(num_buckets, distance, fits):
    from freescale.training.ops.relative_buckets import last_finite_threshold

    exact = last_finite_threshold(num_buckets, distance) > fits
    assert kernel_limits._last_threshold_past(num_buckets, distance, fits) == exact


@pytest.mark.spawns
def test_the_limits_need_no_torch_far_from_them():
    code = ("import sys; from freescale.training.ops.kernel_limits import time_gaps_too_wide, position_table_too_long; "
            "assert time_gaps_too_wide(64, 3e9) and not time_gaps_too_wide(64, 1.3e8); "
            "assert position_table_too_long(64, 2**21) and not position_table_too_long(64, 1024); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "False"


def test_ranks_device_follows_the_backend(no_gpu):
    assert rank_device_type("gloo") == "cpu" and rank_device_type("nccl") == "cuda"
    assert rank_device_type("auto") == "cpu"  # no GPU driver: decided without asking torch


@pytest.mark.parametrize("overrides,refusal", [
    (["--model.hstu.attention_kernel", "triton"], (InputError, "attention_kernel = 'triton' cannot run")),
    (["--model.hstu.attention_kernel", "grouped", *WIDE_GAP, *LONG_HISTORY], None),
    ([*WIDE_GAP, *LONG_HISTORY], None),  # auto: grouped on a CPU machine, which takes any value
    (["--parallel.backend", "nccl", *WIDE_GAP], (ConfigError, "max_time_gap_seconds 3e+09")),  # auto: triton
    (["--parallel.backend", "nccl", *SOFTMAX], (ConfigError, "attention_activation 'softmax'")),
    (SOFTMAX, None),  # auto on a CPU machine: grouped, which computes it
    (["--model.encoder", "sasrec", "--model.hstu.attention_kernel", "triton"], None),  # no HSTU attention
])
def test_the_launch_check_refuses_what_the_ranks_would(no_gpu, overrides, refusal):
    config = load_config(None, overrides)
    if refusal is None:
        check_attention_kernel(config)
        return
    error, fragment = refusal
    with pytest.raises(error, match=fragment.replace("+", r"\+")) as refused:
        check_attention_kernel(config)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("overrides,key", [(WIDE_GAP, "model.hstu.max_time_gap_seconds 3e+09"),
                                           (SOFTMAX, "model.hstu.attention_activation 'softmax'"),
                                           (LONG_HISTORY, f"model.hstu.max_seq_len {2 * POSITION_TABLE_LIMIT}")])
def test_triton_refuses_values_past_its_limits_naming_the_key(monkeypatch, overrides, key):
    """Under the interpreter triton runs on the CPU, so the limits are what stops it; the encoder
    (the ranks' model build) and calibrate's device check refuse the same way."""
    from freescale.jobs.calibrate import calibration_device
    from freescale.training.model.hstu import HSTUEncoder

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    config = load_config(None, ["--model.hstu.attention_kernel", "triton", *overrides])
    for refuse in (lambda: attention_kernel_for(config.model.hstu, "cpu"),
                   lambda: HSTUEncoder(config.model.hstu, config.model.embedding_dim).kernel("cpu"),
                   lambda: calibration_device("cpu", config.model)):
        with pytest.raises(ConfigError, match=key.replace("+", r"\+")):
            refuse()
    assert attention_kernel_for(load_config(None, ["--model.hstu.attention_kernel", "triton"]).model.hstu,
                                "cpu") == "triton"


def test_the_kernel_itself_still_refuses_past_its_limits():
    """For callers of the kernel module that no config check saw."""
    from freescale.training.ops import hstu_attention as ops
    from freescale.training.ops.attention import BiasSpec

    with pytest.raises(ValueError, match="2\\^31"):
        ops.kernel_tables(BiasSpec(8, 64, 8, 3e9, normalizer=0), "cpu")


@pytest.mark.parametrize("value", ["0", "-5", "inf", "nan"])
def test_max_time_gap_must_be_a_positive_number(value):
    with pytest.raises(ConfigError, match="max_time_gap_seconds must be a positive number"):
        load_config(None, ["--model.hstu.max_time_gap_seconds", value])


@pytest.mark.spawns
@pytest.mark.skipif(any(os.path.exists(p) for p in attention_kernel.GPU_DRIVER_PATHS), reason="a GPU machine")
def test_freescale_train_refuses_triton_on_a_cpu_machine_before_torchrun(tmp_path):
    """The launcher itself, in a fresh process whose subprocess.Popen (torchrun's start) fails the test."""
    code = ("import subprocess, sys\n"
            "def torchrun(*args, **kwargs): raise AssertionError('torchrun started')\n"
            "subprocess.Popen = subprocess.run = torchrun\n"
            "from freescale.jobs.launch import launch\n"
            f"status = launch(['--shards', {str(tmp_path)!r}, '--tracking-uri', 'none',\n"
            "                 '--model.hstu.attention_kernel', 'triton'])\n"
            "print('torch' in sys.modules)\n"
            "sys.exit(status)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    started = time.perf_counter()
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env,
                         timeout=60)
    elapsed = time.perf_counter() - started
    assert run.returncode == 2, run.stderr
    assert run.stdout.strip() == "False"  # not even torch was imported
    [line] = run.stderr.strip().splitlines()
    assert line.startswith("freescale train: error: model.hstu.attention_kernel = 'triton' cannot run")
    assert elapsed < 5, f"{elapsed:.1f} s"  # about 0.5 s; torchrun's start would be about 10 s


def test_a_pipeline_config_is_checked_before_its_first_stage(no_gpu, tmp_path):
    from freescale.jobs.workflow.config import load_workflow_config

    path = tmp_path / "pipeline.toml"
    path.write_text('[train.overrides]\n"model.hstu.attention_kernel" = "triton"\n')
    with pytest.raises(ConfigError, match=r"\[train\]: model.hstu.attention_kernel = 'triton' cannot run"):
        load_workflow_config(str(path), [])
    path.write_text('[train.overrides]\n"model.hstu.attention_kernel" = "grouped"\n')
    assert load_workflow_config(str(path), []).train.overrides == {"model.hstu.attention_kernel": "grouped"}
