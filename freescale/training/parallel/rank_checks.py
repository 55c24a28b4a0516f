"""What the ranks would refuse on this machine, refused before torchrun starts: one line each.

Starting the ranks takes about 10 s and importing torch 1.5 s, so ``freescale train``, ``compare``
and ``pipeline`` ask here first, and torch is imported only where the answer depends on whether it
sees a GPU. The ranks make the same checks when they build the model (``HSTUEncoder.kernel``) and
shard it (``shard_model``).
"""
from __future__ import annotations

from freescale.training.model.attention_kernel import check_attention_kernel, rank_device_type
from freescale.training.config import CUDA_ONLY_SPARSE_OPTIMIZERS, ConfigError, TrainConfig


def check_ranks_can_run(config: TrainConfig) -> None:
    """The attention kernel (``check_attention_kernel``), CUDA graphs (``training.cuda_graphs``) and the
    tables' optimizer (``OptimizerConfig.check_device``) on the device the ranks will train on."""
    check_attention_kernel(config)
    if config.training.cuda_graphs != "off" and rank_device_type(config.parallel.backend) != "cuda":
        raise ConfigError(f"training.cuda_graphs = '{config.training.cuda_graphs}' needs CUDA ranks; these ranks "
                          f"train on cpu (parallel.backend = '{config.parallel.backend}'; set training.cuda_graphs "
                          f"= 'off')")
    if config.optimizer.sparse_optimizer in CUDA_ONLY_SPARSE_OPTIMIZERS:
        config.optimizer.check_device(rank_device_type(config.parallel.backend))
