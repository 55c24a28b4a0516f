"""The learning-rate schedule: a linear warm-up, then constant, linear or cosine decay to the
run's planned end, applied to the dense optimizer and the tables' fused optimizers alike.

The rate of step ``s`` is a function of ``s`` alone, so a resumed run follows the same
schedule without saving any of it.
"""
from __future__ import annotations

import math
from typing import Any

from freescale.training.config import OptimizerConfig


class LearningRateSchedule:
    """Each optimizer's configured rate times ``factor(step)``, set before the step trains.

    The fused (sparse) optimizers apply their update inside the backward, reading the rate
    TorchRec's ``FusedOptimizer.step()`` hands the kernel: that is how the rate reaches them.
    """

    def __init__(self, config: OptimizerConfig, horizon: int, dense: Any, fused: list[Any]):
        self.config, self.horizon = config, max(1, horizon)
        # Groups are looked up at every step: loading a checkpoint replaces an optimizer's groups.
        self.rates = [(dense, config.dense_lr)] + [(optimizer, config.sparse_lr) for optimizer in fused]

    @property
    def constant(self) -> bool:
        """Whether every step trains at the configured rates (nothing to set: the default)."""
        return self.config.warmup_steps == 0 and self.config.decay == "constant"

    def factor(self, step: int) -> float:
        """The fraction of the configured rates step ``step`` (0-based) trains with."""
        warmup = self.config.warmup_steps
        if step < warmup:
            return (step + 1) / warmup
        if self.config.decay == "constant":
            return 1.0
        span = max(1, self.horizon - warmup)
        progress = min(1.0, (step - warmup) / span)
        floor = self.config.min_lr_ratio
        if self.config.decay == "linear":
            return floor + (1.0 - floor) * (1.0 - progress)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def apply(self, step: int) -> None:
        if self.constant:
            return
        factor = self.factor(step)
        for optimizer, rate in self.rates:
            for group in optimizer.param_groups:
                group["lr"] = rate * factor
        for optimizer, _ in self.rates[1:]:
            optimizer.step()  # hands the new rate to the fused kernels; their update ran in the backward
