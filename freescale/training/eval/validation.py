"""Validation during training: the validation item scored every ``evaluation.every_epochs``
passes, the best epoch's weights kept, and early stopping after ``evaluation.patience``
validations without a better ``evaluation.metric``.

Both parts are checkpointed: the record (``ValidationRecord``, in every rank's own file; the
scores are all-reduced, so every rank holds the same) and the best weights (``BestWeights``,
through DCP beside the model, so each rank saves its own shards of the tables). A resumed run
therefore stops at the same step and restores the same weights as one never interrupted.
"""
from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from freescale.training.config import EvaluationConfig


@dataclass
class ValidationRecord:
    """What the validations so far decided (identical on every rank)."""

    best_value: float = -math.inf
    best_epoch: int = 0
    """Passes over the shards the best weights had trained (0: no validation yet)."""
    best_step: int = 0
    """Steps the best weights had trained."""
    since_best: int = 0
    """Validations in a row without a better value."""
    stopped: bool = False
    """Early stopping ended the run before its last planned step."""

    def update(self, value: float, epoch: int, step: int, patience: int, last: bool = False) -> bool:
        """Take the validation of ``epoch``; whether its weights are the new best. A NaN score
        (no validation queries) never is. ``last``: the run ends here anyway, so running out of
        patience stops nothing."""
        improved = value > self.best_value
        if improved:
            self.best_value, self.best_epoch, self.best_step, self.since_best = value, epoch, step, 0
        else:
            self.since_best += 1
            self.stopped = bool(patience) and self.since_best >= patience and not last
        return improved

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            setattr(self, name, value)


class BestWeights:
    """A copy of the model's state (this rank's shards of the tables, the dense parameters) taken
    at the best validation, written back before the test evaluation. A ``Stateful`` for DCP: its
    state dict has the model's keys and layout, so the checkpoint saves and loads it like the model."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.saved = self._copy()  # the initial weights until the first validation: DCP loads in place

    def _copy(self) -> dict[str, Any]:
        return {name: copy.deepcopy(value) if is_sharded(value) else value.detach().clone()
                for name, value in self.model.state_dict().items()}

    def keep(self) -> None:
        for name, value in self.model.state_dict().items():
            _copy_into(self.saved[name], value)

    def restore(self) -> None:
        with torch.no_grad():
            for name, value in self.model.state_dict().items():
                _copy_into(value, self.saved[name])

    def state_dict(self) -> dict[str, Any]:
        return self.saved

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            if value is not self.saved[name]:
                _copy_into(self.saved[name], value)


def is_sharded(value: Any) -> bool:
    return hasattr(value, "local_shards")  # torch.distributed's ShardedTensor


def _copy_into(target: Any, source: Any) -> None:
    """Copy ``source``'s values into ``target`` in place (tensors, or the local shards of sharded ones)."""
    if is_sharded(target):
        for into, shard in zip(target.local_shards(), source.local_shards()):
            into.tensor.detach().copy_(shard.tensor)
    else:
        target.detach().copy_(source)


class Validation:
    """When to validate, what the record says, and the best weights (None: not kept)."""

    def __init__(self, config: EvaluationConfig, steps_per_epoch: int, model: nn.Module):
        self.config, self.steps_per_epoch = config, max(1, steps_per_epoch)
        self.record = ValidationRecord()
        self.enabled = config.every_epochs > 0
        self.best = BestWeights(model) if self.enabled and config.restore_best else None

    def due(self, step: int) -> bool:
        """Whether the run validates after ``step`` steps (at the end of every N-th pass)."""
        every = self.config.every_epochs * self.steps_per_epoch
        return self.enabled and step > 0 and step % every == 0

    def next_at(self, step: int) -> int | None:
        """The step count of the next validation after ``step`` (None: the run never validates)."""
        if not self.enabled:
            return None
        every = self.config.every_epochs * self.steps_per_epoch
        return (step // every + 1) * every

    def take(self, scores: dict[str, float], step: int, last: bool) -> bool:
        """Record the validation after ``step`` steps (``last``: the run's last step); whether it is
        the best so far."""
        improved = self.record.update(scores[self.config.metric], step // self.steps_per_epoch, step,
                                      self.config.patience, last)
        if improved and self.best is not None:
            self.best.keep()
        return improved

    def summary(self) -> dict[str, float]:
        """The run summary's validation entries (none without validation during training)."""
        if not self.enabled:
            return {}
        return {"best_epoch": float(self.record.best_epoch), "best_step": float(self.record.best_step),
                f"best_{self.config.metric}": float(self.record.best_value),
                "stopped_early": float(self.record.stopped)}
