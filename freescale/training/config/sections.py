"""The trainer config's other sections (``[data]``, ``[optimizer]``, ``[loss]``, ``[training]``,
``[parallel]``, ``[comm]``, ``[checkpoint]``, ``[tracking]``, ``[evaluation]``) and the whole config,
``TrainConfig``."""
from __future__ import annotations

import typing
from dataclasses import dataclass, field

from freescale.comm.names import BackendName as CommBackendName
from freescale.runtime.typed_config import ConfigError, check_choices
from freescale.tracking.store import DEFAULT_EXPERIMENT
from freescale.training.config.choices import (CUDA_ONLY_SPARSE_OPTIMIZERS, CommMode, CudaGraphs, LearningRateDecay,
                                               LossKind, ParallelBackendName, Precision, ShardingName,
                                               SparseOptimizerName, ValidationMetric, shape)
from freescale.training.config.model import ModelConfig


@dataclass
class DataConfig:
    shards: str = ""
    """Shard directory written by `freescale balance` (holds manifest.json)."""
    prefetch: int = 2
    """Collated step batches prepared ahead of the trainer on a background thread."""
    verify_checksums: bool = False
    """Hash every file of this rank against the manifest before training (slow on big shards)."""
    replan: str = ""
    """A re-plan of the rest of an epoch for this launch's world size (``freescale.shards.replan``), trained
    instead of the plan's own steps. `freescale train` sets it on a resume on another world size."""


@dataclass
class OptimizerConfig:
    dense_lr: float = 1e-3
    """Adam learning rate of the dense (replicated) parameters."""
    sparse_lr: float = 0.05
    """Learning rate of the embedding tables' optimizer (the item table and the user
    feature tables), fused into their backward."""
    sparse_optimizer: SparseOptimizerName = shape("adagrad")
    """Fused sparse optimizer: adagrad (row-wise), sgd or adam (each keeps differently shaped state).
    adam needs CUDA: fbgemm has no CPU kernel for it (``check_device``)."""
    weight_decay: float = 0.0
    """Dense weight decay (Adam's L2 term)."""
    warmup_steps: int = 0
    """Both learning rates rise linearly from ``lr / warmup_steps`` to ``lr`` over this many steps."""
    decay: LearningRateDecay = "constant"
    """After the warm-up, both learning rates stay (``"constant"``) or fall, linearly or along
    a half cosine, to ``min_lr_ratio x lr`` at the run's planned end: ``training.max_epochs``
    passes (``training.max_steps`` when that is 0). A run stopped before its planned end,
    early or by ``max_steps``, has followed the same schedule as far as it went."""
    min_lr_ratio: float = 0.0
    """Where ``"linear"`` and ``"cosine"`` decay end, as a fraction of each learning rate."""
    max_grad_norm: float = 0.0
    """Clip the dense gradients (after the ranks' average) to this global L2 norm; 0 = no
    clipping. The embedding tables' gradients are applied inside their backward (fused) and
    are not clipped."""

    def __post_init__(self) -> None:
        # Also run by load_config after a file or override changed the fields.
        check_choices(self, ("decay",))
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.max_grad_norm < 0:
            raise ValueError(f"max_grad_norm must be >= 0 (0 = no clipping), got {self.max_grad_norm}")

    def check_device(self, device_type: str) -> None:
        """Refuse a sparse optimizer fbgemm has no kernel for on ``device_type`` (``"cpu"``, ``"cuda"``):
        one line, where fbgemm would stop the first step with an assertion."""
        if self.sparse_optimizer in CUDA_ONLY_SPARSE_OPTIMIZERS and device_type.split(":")[0] != "cuda":
            cpu = "', '".join(o for o in typing.get_args(SparseOptimizerName) if o not in CUDA_ONLY_SPARSE_OPTIMIZERS)
            raise ConfigError(f"optimizer.sparse_optimizer = '{self.sparse_optimizer}' needs CUDA (fbgemm has no "
                              f"CPU kernel for it) and this job trains on {device_type}: choose '{cpu}'")


@dataclass
class LossConfig:
    kind: LossKind = "sampled_softmax"
    """``"sampled_softmax"``: each position's target against shared negatives (``num_negatives``
    uniform ids plus in-batch targets, or the catalog with ``full_softmax``). ``"bce"``: SASRec's
    binary cross-entropy, each position's target against one negative of its own, uniform over
    the catalog (a negative equal to the target is masked: that position keeps only its
    positive term); ``num_negatives`` and ``model.in_batch_negatives`` do not apply. Both are
    means over the step's targets."""
    num_negatives: int = 128
    """Uniformly sampled negatives per step, shared by every position of the batch (sampled softmax)."""
    full_softmax: bool = False
    """Score every position against the whole catalog (small catalogs only; sampled softmax)."""

    def __post_init__(self) -> None:
        # Also run by load_config after a file or override changed the fields.
        if self.kind == "bce" and self.full_softmax:
            raise ValueError("full_softmax applies to kind 'sampled_softmax' only; kind 'bce' draws "
                             "one negative per position")


@dataclass
class TrainingConfig:
    max_steps: int = 0
    """Stop after this many steps (at most ``max_epochs`` passes when that is set); 0 = one
    pass over the shards (the manifest's num_steps), or ``max_epochs`` passes."""
    max_epochs: int = 0
    """Passes over the shards the run plans (0: see ``max_steps``): the learning-rate decay's
    horizon, and where the run ends unless ``max_steps`` or early stopping ends it first."""
    seed: int = 0
    """Seeds parameters, negative sampling and dropout; ranks derive their own streams from it."""
    init_from: str = ""
    """A warm start (`freescale train --init-from`): a new run, from step 0, whose weights come from
    a checkpoint (a ``step_<n>`` folder, or a checkpoint folder's newest complete step) or an exported
    model folder (`freescale export`), and its optimizers' state from the checkpoint's, where the
    shapes allow (``freescale.training.checkpoint.init_from``). The item table may grow: rows past
    the source's start as a cold start's. A run that resumes its own checkpoint ignores it. Empty:
    a cold start."""
    log_every: int = 10
    """Print and record metrics every N steps."""
    timing_sync_every: int = 1
    """All-gather per-rank step timings every N steps (bubble measurement)."""
    eval_max_samples: int = 0
    """Evaluate at most this many samples per rank; 0 = all of the rank's shard."""
    threads: int = 0
    """torch intra-op threads per rank; 0 = cores / local ranks."""
    precision: Precision = "fp32"
    """Arithmetic of the encoder (HSTU or SASRec), in training and evaluation alike. ``"fp32"``:
    fp32 throughout (the Triton attention kernel's dots in TF32). ``"bf16"``: the
    encoder's forward runs under ``torch.autocast`` in bfloat16 (matmuls and attention in bf16,
    the Triton kernel accumulating in fp32), on CUDA and CPU alike; parameters, gradients and
    optimizer state stay fp32 (bf16 has fp32's range, so no loss scaling), and the embedding
    tables, the inputs' sums and the loss stay fp32. ``freescale calibrate`` times the model at
    this precision, and ``benchmarks/hstu_gpu_bench.py`` reads it (``--precision``)."""
    cuda_graphs: CudaGraphs = "off"
    """``"encoder"``: the encoder's training forward and backward replay CUDA graphs, one pair per
    padded batch shape (``freescale.training.model.encoder_graphs``: rows padded by under 12.5%), so a step issues
    about a dozen launches instead of ~45 per layer; CUDA only (refused on CPU). Evaluation and
    other no-grad forwards stay eager. ``freescale calibrate`` times the model this way too."""

    def __post_init__(self) -> None:
        # Also run by load_config after a file or override changed the fields.
        check_choices(self, ("precision", "cuda_graphs"))
        if self.max_steps < 0:
            raise ValueError(f"max_steps must be >= 0 (0 = one pass over the shards), got {self.max_steps}")
        if self.max_epochs < 0:
            raise ValueError(f"max_epochs must be >= 0 (0 = as max_steps says), got {self.max_epochs}")


@dataclass
class ParallelConfig:
    backend: ParallelBackendName = "auto"
    """Process-group backend: auto (nccl on CUDA, else gloo), gloo or nccl."""
    sharding: ShardingName = "row_wise"
    """Item table sharding: row_wise or table_wise."""
    init_timeout_s: float = 600.0
    """Bounds each collective until the first step this process trains has ended on every rank:
    joining, restoring a checkpoint, building the model, rank 0 starting its MLflow run, the first
    step's compiles. One rank's set-up runs while its peers wait, so it gets its own bound."""
    collective_timeout_s: float = 300.0
    """After the first step: a rank blocked this long in a collective (a peer died or hangs) fails
    instead of waiting forever."""

    def __post_init__(self) -> None:
        for name in ("init_timeout_s", "collective_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


@dataclass
class CommConfig:
    mode: CommMode = "prioritized"
    """How the step's collectives run. ``plain``: TorchRec's blocking lookups and one
    all-reduce after the backward (the baseline). ``overlap``: every collective is
    asynchronous and waited for where its result is first needed -- the next batch's
    ids move during this step, embedding gradients leave as soon as they are ready,
    dense gradients are all-reduced in buckets during the backward. ``prioritized``:
    ``overlap`` with the rows sent in ``priority_groups`` order, the encoder starting
    once the first group is in, and the embedding gradients issued ahead of the last
    dense bucket. All three compute the same numbers."""
    backend: CommBackendName = "auto"
    """Transport of the exchange and the dense sync: gloo (CPU), nccl (CUDA SM kernels),
    copy_engine (CUDA copy engines, SM-free); auto = nccl on CUDA, else gloo."""
    priority_groups: str = "item,user;negative"
    """Exchange groups in priority order, ``;`` between groups and ``,`` between features:
    ``item`` (history items), ``negative`` (sampled negatives), a user feature's name, or
    ``user`` for every user feature. Features not named join the last group."""
    bucket_kb: int = 256
    """Dense gradients per all-reduce bucket (KiB)."""


@dataclass
class CheckpointConfig:
    folder: str = ""
    """Where torch.distributed.checkpoint writes step_<n>/; empty disables checkpoints."""
    every_steps: int = 0
    """Save every N steps (0: only at the end when a folder is set)."""
    resume: bool = True
    """Continue from the newest complete checkpoint in the folder, if any."""
    keep_last: int = 3
    """Keep the newest N complete checkpoints: after a save is complete, older ones are deleted
    (0: keep all)."""

    def __post_init__(self) -> None:
        # Also run by load_config after a file or override changed the fields.
        if self.keep_last < 0:
            raise ValueError(f"keep_last must be >= 0 (0 = keep all), got {self.keep_last}")


@dataclass
class TrackingConfig:
    uri: str = ""
    """MLflow tracking URI; empty = $MLFLOW_TRACKING_URI or sqlite:///mlflow.db; 'none' disables."""
    experiment: str = DEFAULT_EXPERIMENT
    """MLflow experiment name."""
    run_name: str = ""
    """MLflow run name; empty = derived from the shards and strategy."""
    parent_run_id: str = ""
    """Nest this run under that MLflow run (``freescale compare``'s parent run); empty = a top-level run."""
    comparison: str = ""
    """The ``freescale compare`` this run belongs to (its tag ``freescale.comparison``); empty = none."""


@dataclass
class EvaluationConfig:
    sampled_negatives: int = 0
    """0: rank the held-out item against the whole catalog. N > 0: also rank it against N items
    drawn uniformly from those the user never interacted with in training (the protocol of
    SASRec and its successors, N = 100); validation and test use the same protocol."""
    every_epochs: int = 0
    """Score the validation item every N passes over the shards (both protocols), recorded as
    the series ``epoch/valid_*``, and keep the best weights by ``metric``; 0 = only at the end."""
    unseen_ranking: bool = False
    """Also rank the held-out item against the catalog less the query's own history, as the
    exported model's ``predict`` does by default: ``unseen_hr_at_10``, ... (``valid_unseen_*``,
    and the most-popular baseline's ``popular_unseen_*``), beside the whole catalog's. Where a user
    never meets an item twice (MovieLens-100K, Amazon Beauty and Sports), a history item ranked
    above the target can only cost, and this ranking shows how much it did."""
    metric: ValidationMetric = "valid_ndcg_at_10"
    """The validation score that decides the best epoch (higher is better)."""
    patience: int = 0
    """Stop after this many validations in a row without a better ``metric``; 0 = never stop early."""
    restore_best: bool = True
    """With validation during training: score the test item with the best epoch's weights
    (the summary's ``best_epoch``), not the last step's."""

    def __post_init__(self) -> None:
        if self.sampled_negatives < 0:
            raise ValueError(f"sampled_negatives must be >= 0 (0 = full-catalog ranking), got {self.sampled_negatives}")
        check_choices(self, ("metric",))
        if self.every_epochs and self.metric.startswith("valid_sampled_") and not self.sampled_negatives:
            raise ValueError(f"metric {self.metric!r} needs sampled_negatives > 0")
        for name in ("every_epochs", "patience"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.patience and not self.every_epochs:
            raise ValueError("patience needs every_epochs > 0 (early stopping follows the validations)")


@dataclass
class TrainConfig:
    data: DataConfig = field(default_factory=DataConfig)
    """``[data]``: which shards to read and how."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """``[model]`` and its encoders' sections (``[model.hstu]``, ``[model.sasrec]``): the recommender
    and its encoder."""
    loss: LossConfig = field(default_factory=LossConfig)
    """``[loss]``: the loss kind and its negatives."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """``[optimizer]``: dense and fused sparse optimizers."""
    training: TrainingConfig = field(default_factory=TrainingConfig)
    """``[training]``: steps, seed, logging, evaluation, precision."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """``[parallel]``: process group and table sharding."""
    comm: CommConfig = field(default_factory=CommConfig)
    """``[comm]``: how the step's collectives run."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """``[checkpoint]``: where and how often to save, and whether to resume."""
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    """``[tracking]``: the MLflow run."""
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    """``[evaluation]``: the ranking protocol of validation and test."""

