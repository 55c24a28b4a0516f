"""What the ranks would refuse on this machine is refused before torchrun starts, in one line: here the
tables' optimizer fbgemm has no CPU kernel for (the attention kernel's refusals: test_attention_kernel.py)."""
from __future__ import annotations

import pytest
import torch

from freescale.runtime.job_errors import EXIT_BAD_INPUT
from freescale.training.config import CUDA_ONLY_SPARSE_OPTIMIZERS, ConfigError, OptimizerConfig, ParallelConfig, load_config
from freescale.training.parallel.rank_checks import check_ranks_can_run

ADAM = ["--optimizer.sparse_optimizer", "adam"]


@pytest.mark.parametrize("optimizer", ["adagrad", "sgd", "adam"])
@pytest.mark.parametrize("device_type", ["cpu", "cuda", "cuda:1"])
def test_only_adam_needs_cuda(optimizer, device_type):
    config = OptimizerConfig(sparse_optimizer=optimizer)
    if optimizer in CUDA_ONLY_SPARSE_OPTIMIZERS and device_type == "cpu":
        with pytest.raises(ConfigError) as refused:
            config.check_device(device_type)
        assert str(refused.value) == ("optimizer.sparse_optimizer = 'adam' needs CUDA (fbgemm has no CPU kernel "
                                      "for it) and this job trains on cpu: choose 'adagrad', 'sgd'")
    else:
        config.check_device(device_type)


@pytest.mark.parametrize("backend,refused", [("gloo", True), ("nccl", False)])
def test_the_launch_check_follows_the_ranks_device(backend, refused):
    config = load_config(None, [*ADAM, "--parallel.backend", backend])
    if refused:
        with pytest.raises(ConfigError, match="needs CUDA"):
            check_ranks_can_run(config)
    else:
        check_ranks_can_run(config)  # nccl trains on CUDA, where fbgemm has adam
    check_ranks_can_run(load_config(None, ["--parallel.backend", "gloo"]))  # the default, adagrad


def test_freescale_train_refuses_sparse_adam_on_the_cpu_before_torchrun(fresh_log, tmp_path, capsys):
    from freescale.jobs.launch import launch

    assert launch(["--shards", str(tmp_path), "--tracking-uri", "none", "--parallel.backend", "gloo", *ADAM]) \
        == EXIT_BAD_INPUT
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == ("freescale train: error: optimizer.sparse_optimizer = 'adam' needs CUDA (fbgemm has no "
                            "CPU kernel for it) and this job trains on cpu: choose 'adagrad', 'sgd'\n")
    assert not fresh_log.exists()  # no rank ever started


def test_a_rank_refuses_it_before_sharding():
    """What a rank sees when no launcher checked first (a rank started by hand, or by torchrun directly)."""
    from freescale.training.parallel.distributed import DistEnv
    from freescale.training.parallel.sharding import shard_model

    env = DistEnv(0, 1, 0, 1, torch.device("cpu"), "gloo")
    with pytest.raises(ConfigError, match="^optimizer.sparse_optimizer = 'adam' needs CUDA"):
        shard_model(None, OptimizerConfig(sparse_optimizer="adam"), ParallelConfig(), env)


@pytest.mark.parametrize("backend,refused", [("gloo", True), ("nccl", False)])
def test_cuda_graphs_need_cuda_ranks(backend, refused):
    config = load_config(None, ["--training.cuda_graphs", "encoder", "--parallel.backend", backend])
    if refused:
        with pytest.raises(ConfigError) as error:
            check_ranks_can_run(config)
        assert str(error.value) == ("training.cuda_graphs = 'encoder' needs CUDA ranks; these ranks train on cpu "
                                    "(parallel.backend = 'gloo'; set training.cuda_graphs = 'off')")
    else:
        check_ranks_can_run(config)


def test_the_model_refuses_cuda_graphs_off_cuda():
    from freescale.training.config import ModelConfig
    from freescale.training.model.recommender import build_dense_model

    with pytest.raises(ConfigError, match="training.cuda_graphs = 'encoder' needs a CUDA device; this model is on cpu"):
        build_dense_model(10, ModelConfig(), cuda_graphs="encoder")
