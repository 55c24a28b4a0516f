"""Trainer configuration: typed dataclasses, loaded from TOML, overridden from the command line.

Plain dataclasses that import nothing from the model (so jobs can read a config without
loading torch). Every choice is a ``Literal`` checked when the config loads: a bad value
stops the run with one line naming the key and the allowed values, before any rank starts
work. Modules that map a choice to an implementation key their mapping by the Literal's
values (``keyed_by`` checks at import that the two agree).

    [training]
    max_steps = 100
    [model.hstu]
    num_layers = 2

    torchrun ... -m freescale.jobs.train --config configs/ml100k.toml --training.max_steps 20 --data.shards out/s
"""
from __future__ import annotations

import dataclasses
import math
import tomllib
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from freescale.comm.names import BackendName as CommBackendName
from freescale.runtime.errors import InputError
from freescale.tracking.store import DEFAULT_EXPERIMENT

ShardingName = Literal["row_wise", "table_wise"]
ParallelBackendName = Literal["auto", "gloo", "nccl"]
SparseOptimizerName = Literal["adagrad", "sgd", "adam"]
# fbgemm's CPU embedding kernels take exact (row-wise) adagrad and SGD only.
CUDA_ONLY_SPARSE_OPTIMIZERS: tuple[SparseOptimizerName, ...] = ("adam",)
AttentionNormalization = Literal["sample_length", "max_seq_len"]
AttentionActivation = Literal["silu", "softmax"]
HSTUInit = Literal["torch", "reference"]
CommMode = Literal["plain", "overlap", "prioritized"]
AttentionKernelName = Literal["triton", "grouped"]
AttentionKernel = Literal["auto", AttentionKernelName]  # flattens to "auto" | "triton" | "grouped"
LossKind = Literal["sampled_softmax", "bce"]
LearningRateDecay = Literal["constant", "linear", "cosine"]
Precision = Literal["fp32", "bf16"]
CudaGraphs = Literal["off", "encoder"]
# The validation metrics early stopping can follow: the summary's names of the validation item's
# scores (``freescale.training.eval.evaluator``); the sampled ones need ``evaluation.sampled_negatives > 0``.
ValidationMetric = Literal["valid_ndcg_at_10", "valid_hr_at_10", "valid_mrr",
                           "valid_sampled_ndcg_at_10", "valid_sampled_hr_at_10", "valid_sampled_mrr"]


@dataclass(frozen=True)
class OneOf:
    """A choice whose values are known only at run time, in ``Annotated[str, OneOf(values)]``: checked
    at load like a ``Literal`` (the same one line), against ``values()`` as it is then."""

    values: Callable[[], tuple[str, ...]]


# Field metadata key: the field's value sizes saved tensors (``shape``).
SHAPE = "shape"


def shape(default: Any) -> Any:
    """A config field whose value sizes parameters or optimizer state: a checkpoint cannot be loaded
    into a model built with another value, so a resume that changes it is refused (``shape_keys``).
    Everything else about an encoder (dropout, bucketing, kernels) may change across a resume."""
    return field(default=default, metadata={SHAPE: True})


@dataclass
class HSTUConfig:
    """Shape and regularisation of the HSTU encoder (``freescale.training.model.hstu``; ``[model.hstu]``). Its width
    is the model's, ``model.embedding_dim``."""

    num_layers: int = shape(2)
    """Number of stacked HSTU layers."""
    num_heads: int = shape(2)
    """Attention heads per layer."""
    attention_dim: int = shape(32)
    """Per-head width of Q and K."""
    linear_dim: int = shape(32)
    """Per-head width of V and of the gate U."""
    dropout: float = 0.1
    """Dropout on the input embeddings and on each layer's gated attention output."""
    max_seq_len: int = 1024
    """Longest history the model is trained on; the position buckets span ``0..max_seq_len``
    (it changes the bucketing, not a shape)."""
    num_position_buckets: int = shape(64)
    """Buckets for relative positions ``i - j``; log-spaced so nearby positions stay distinct."""
    num_time_buckets: int = shape(64)
    """Buckets for time gaps ``|t_i - t_j|`` in seconds; log-spaced from 1 s to ``max_time_gap_seconds``."""
    max_time_gap_seconds: float = 4 * 365 * 86400.0
    """Time gap that maps to the last time bucket; longer gaps share it."""
    attention_normalization: AttentionNormalization = "sample_length"
    """Divisor ``n`` of the attention weights: ``"sample_length"`` (the sample's own
    length, as specified for FreeScale) or ``"max_seq_len"`` (a constant, as in the
    reference implementation, which pads to the max length). LayerNorm after ``A V``
    absorbs the scale up to its epsilon, so the choice rarely matters."""

    attention_activation: AttentionActivation = "silu"
    """What turns a score into a weight. ``"silu"`` (default): the paper's pointwise
    ``SiLU(s) / n``, where a weight does not depend on the other keys. ``"softmax"``: a
    Transformer's (SASRec's) ``softmax_j(q.k / sqrt(attention_dim) + biases)`` over the causal
    keys, no ``n``: the paper's own ablation, to measure what the pointwise form costs or buys on a
    dataset. The grouped kernel only: triton refuses it. Experimental (issue 27)."""
    position_embeddings: int = shape(0)
    """Learned absolute position embeddings added to the encoder's inputs, for positions
    ``0..position_embeddings-1`` counted from a history's oldest item (later positions share the
    last one), as SASRec here (``freescale.training.ops.jagged.jagged_positions``) and the reference HSTU code's
    input preprocessor; started at the inputs' spread. 0 (default): none, the paper's formula, where
    order reaches the model through the relative position and time biases only. Experimental (issue 27)."""
    output_norm: bool = shape(False)
    """A LayerNorm over the last layer's output before the L2 normalisation (SASRec's final
    LayerNorm here). False (default): none."""
    feed_forward_dim: int = shape(0)
    """Hidden width of a point-wise feed-forward block after each layer, SASRec's
    (``Y + Dropout(FFN(LayerNorm(Y)))``, ``freescale.training.model.encoders.feed_forward_network``). 0 (default):
    none, the paper's layer, whose gate U stands in for the FFN. Experimental (issue 27)."""
    norm_affine: bool = shape(True)
    """Learned scale and shift in each layer's two LayerNorms (on ``X`` and on ``A V``). False: none,
    as in Meta's reference code (its ``F.layer_norm`` takes no weight). Experimental (issue 27)."""
    init: HSTUInit = "torch"
    """Initial weights of each layer's projections. ``"torch"`` (default): ``nn.Linear``'s own
    (Kaiming-uniform weights and biases). ``"reference"``: Meta's reference code's, ``W_uvqk`` drawn
    from N(0, 0.02) and ``W_o`` Xavier-uniform, with both biases started at zero (the reference has
    none on ``W_uvqk``; here it stays, learned). Experimental (issue 27)."""
    attention_block_size: int = 128
    """Query rows per attention block of the grouped kernel; bounds the working set of
    long samples and lets the causal mask skip whole key blocks (see ``AttentionBlock``)."""
    attention_kernel: AttentionKernel = "auto"
    """How attention runs. ``"triton"``: one jagged Triton kernel per layer and direction
    (``freescale.training.ops.hstu_attention``), needs a CUDA device (or ``TRITON_INTERPRET=1``, for
    tests); ``"grouped"``: PyTorch ops per group of equal-length samples, the CPU path and
    the kernel's reference; ``"auto"``: triton on CUDA, grouped on CPU. Both compute the
    same numbers. Asking for triton where it cannot run stops the job, never falls back; so does
    triton with a value it cannot take (``max_seq_len`` past 2^20, ``max_time_gap_seconds`` past
    2^31 s), which the grouped path takes. ``freescale train`` checks both before torchrun starts
    (``freescale.training.model.attention_kernel``)."""

    def __post_init__(self) -> None:
        # Also run by load_config after a file or override changed the fields.
        for name, choice in (("attention_normalization", AttentionNormalization),
                             ("attention_activation", AttentionActivation),
                             ("attention_kernel", AttentionKernel), ("init", HSTUInit)):
            allowed = typing.get_args(choice)
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.position_embeddings < 0:
            raise ValueError(f"position_embeddings must be >= 0 (0 = none), got {self.position_embeddings}")
        if self.feed_forward_dim < 0:
            raise ValueError(f"feed_forward_dim must be >= 0 (0 = none), got {self.feed_forward_dim}")
        for name in ("num_layers", "num_heads", "attention_dim", "linear_dim",
                     "max_seq_len", "num_position_buckets", "num_time_buckets", "attention_block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        # The time buckets' scale divides by log1p(max_time_gap_seconds): 0 failed at the first step.
        if not 0.0 < self.max_time_gap_seconds < math.inf:
            raise ValueError(f"max_time_gap_seconds must be a positive number of seconds, "
                             f"got {self.max_time_gap_seconds}")


@dataclass
class SASRecConfig:
    """Shape and regularisation of the SASRec encoder (``freescale.training.model.sasrec``; ``[model.sasrec]``; Kang &
    McAuley, "Self-Attentive Sequential Recommendation", ICDM 2018).

    Its width is the model's, ``model.embedding_dim`` (the item table's, which SASRec shares between
    its input and its output); so is the rating input (``model.use_rating_feature``): set it false
    for the paper's item-only inputs."""

    num_layers: int = shape(2)
    """Self-attention blocks (attention + point-wise feed-forward); the paper uses 2."""
    num_heads: int = 1
    """Attention heads per block; must divide the width. The paper found one head enough."""
    feed_forward_dim: int = shape(0)
    """Hidden width of the point-wise feed-forward network; 0 = the model width, as in the paper."""
    dropout: float = 0.2
    """Dropout on the input embeddings, the attention weights and each block's two outputs
    (the paper: 0.2 on MovieLens-1M, 0.5 on sparser data)."""
    max_seq_len: int = shape(200)
    """Learned absolute position embeddings ``0..max_seq_len-1``, counted from a history's
    oldest item; positions past the last share its embedding (the paper's window: 200 on
    MovieLens-1M, 50 on sparser data)."""

    def __post_init__(self) -> None:
        # Also run by load_config after a file or override changed the fields.
        for name in ("num_layers", "num_heads", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.feed_forward_dim < 0:
            raise ValueError(f"feed_forward_dim must be >= 0 (0 = the model width), got {self.feed_forward_dim}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    def check_with(self, model: "ModelConfig") -> None:
        """Checks against the model's own keys, when SASRec is the model's encoder."""
        if model.embedding_dim % self.num_heads:
            raise ValueError(f"sasrec.num_heads {self.num_heads} must divide the model width embedding_dim "
                             f"{model.embedding_dim}")


@dataclass
class ModelConfig:
    """The recommender (``freescale.training.model.recommender``): its width, inputs, scores and negatives, and its encoder,
    ``encoder``, shaped by its own section ``[model.<encoder>]``."""

    encoder: EncoderName = shape("hstu")
    """Sequence encoder, a name in ``ENCODERS``: ``"hstu"`` (``freescale.training.model.hstu``, shaped by
    ``model.hstu``) or ``"sasrec"`` (``freescale.training.model.sasrec``, the SASRec baseline, shaped by
    ``model.sasrec``), or one registered with ``freescale.training.model.registry.register_encoder``. Whichever it is, the item tables,
    user features, loss, comm modes, checkpoints and evaluation are the same."""
    embedding_dim: int = shape(64)
    """Width ``D`` of the model: the item and user feature tables' rows, the rating embedding, and
    the encoder's input and output (its residual stream). Was ``model.hstu.embedding_dim``, which
    still loads (``MOVED_KEYS``)."""
    use_rating_feature: bool = shape(True)
    """Add a learned embedding of the rating (1..5; 0 = unknown contributes nothing) to each input
    position, whichever the encoder. Was ``model.hstu.use_rating_feature``, which still loads."""
    hstu: HSTUConfig = field(default_factory=HSTUConfig)
    """HSTU encoder configuration (used when ``encoder = "hstu"``)."""
    sasrec: SASRecConfig = field(default_factory=SASRecConfig)
    """SASRec encoder configuration (used when ``encoder = "sasrec"``)."""
    temperature: float = 0.05
    """Logits are cosine similarities (both sides are L2-normalised) divided by this, for
    either ``loss.kind`` and any encoder."""
    in_batch_negatives: bool = True
    """Also use the batch's (unique) target items as negatives for every query."""
    max_in_batch_negatives: int = 128
    """At most this many in-batch negatives (a random subset of the unique targets; 0 = all).
    Uncapped, the logits cost tokens x unique targets per rank, which grows with the
    square of a rank's batch rather than per sample, so no per-sample cost model (and
    no balancer) could follow it; capped, a rank's cost stays the sum of its samples'."""
    embedding_init_scale: float = 0.05
    """Item table rows start uniform in ``[-scale, scale]``. Set explicitly because
    TorchRec's default, ``sqrt(1 / num_embeddings)``, shrinks with the catalog and
    would let the rating embedding swamp item identity in large catalogs."""

    def extra_sections(self) -> dict[str, Any]:
        """The sections of encoders registered beyond the fields above (``register_encoder``), by name:
        ``[model.<name>]`` loads, overrides and records like ``[model.hstu]``."""
        declared = {f.name for f in dataclasses.fields(self)}
        return {name: getattr(self, name) for name in ENCODERS if name not in declared}

    @property
    def encoder_config(self) -> Any:
        """The chosen encoder's section, ``[model.<encoder>]``."""
        return getattr(self, self.encoder)

    @property
    def max_seq_len(self) -> int:
        """The chosen encoder's ``max_seq_len``: the longest history it is shaped for."""
        return self.encoder_config.max_seq_len

    @property
    def input_spread(self) -> float:
        """Per-coordinate std of an encoder's input row at initialisation (an item row, uniform
        ``+-embedding_init_scale``, times ``sqrt(embedding_dim)``): what an encoder's own input
        embeddings (SASRec's positions) start at, so they neither swamp item identity nor vanish."""
        return self.embedding_init_scale / math.sqrt(3.0) * math.sqrt(self.embedding_dim)

    def __post_init__(self) -> None:
        # Also run by load_config after a file or override changed the fields.
        if self.encoder not in ENCODERS:  # a file or override was checked already; a constructor was not
            raise ValueError(f"encoder must be one of {tuple(ENCODERS)}, got {self.encoder!r}")
        for name, section in ENCODERS.items():  # encoders registered after this class: a section each
            if not hasattr(self, name):
                setattr(self, name, section())
        if self.embedding_dim < 1:
            raise ValueError(f"embedding_dim must be >= 1, got {self.embedding_dim}")
        check_with = getattr(self.encoder_config, "check_with", None)
        if check_with is not None:
            check_with(self)


# model.encoder -> the class of its section ``[model.<name>]``: the names a config may give and what
# each section loads into. The encoders themselves (how each is built, what each refuses) are the
# model's registry, ``freescale.training.model.registry``, which declares its names here; a config loads
# without it, and so without torch.
ENCODERS: dict[str, type] = {"hstu": HSTUConfig, "sasrec": SASRecConfig}

# model.encoder's type: a name ENCODERS holds when the config loads.
EncoderName = Annotated[str, OneOf(lambda: tuple(ENCODERS))]


def declare_encoder_section(name: str, section: type) -> None:
    """Make ``model.encoder = name`` a choice shaped by ``[model.<name>]`` (a ``section``); configs made
    from then on carry the section (``ModelConfig.extra_sections``). Declaring a name again with the
    class it has already does nothing (the built-in encoders' sections are declared above)."""
    if ENCODERS.get(name) is section:
        return
    # A ModelConfig field may be the encoder's own section (hstu, sasrec); any other is a model key.
    model_keys = {f.name for f in dataclasses.fields(ModelConfig) if f.default_factory is not section}
    if name in ENCODERS or name in model_keys or not name.isidentifier():
        raise ValueError(f"cannot register encoder {name!r}: taken, or not a plain name "
                         f"(registered: {', '.join(ENCODERS)}; model keys: {', '.join(sorted(model_keys))})")
    fields = {f.name for f in dataclasses.fields(section)} if dataclasses.is_dataclass(section) else set()
    if "max_seq_len" not in fields:
        raise TypeError(f"encoder {name!r}: its config must be a dataclass with a max_seq_len field")
    ENCODERS[name] = section


# Keys that moved, old spelling -> new: config files, overrides and checkpoints' recorded configs
# may still use the old one (both in one config is refused).
MOVED_KEYS = {"model.hstu.embedding_dim": "model.embedding_dim",
              "model.hstu.use_rating_feature": "model.use_rating_feature"}


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
        if self.decay not in typing.get_args(LearningRateDecay):
            raise ValueError(f"decay must be one of {typing.get_args(LearningRateDecay)}, got {self.decay!r}")
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
        for name, choice in (("precision", Precision), ("cuda_graphs", CudaGraphs)):
            if getattr(self, name) not in typing.get_args(choice):
                raise ValueError(f"{name} must be one of {typing.get_args(choice)}, got {getattr(self, name)!r}")
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
    collective_timeout_s: float = 300.0
    """A rank blocked this long in a collective (a peer died or hangs) fails instead of waiting forever."""


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
        if self.metric not in typing.get_args(ValidationMetric):
            raise ValueError(f"metric must be one of {typing.get_args(ValidationMetric)}, got {self.metric!r}")
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


class ConfigError(InputError):
    """A config file or override that does not fit the schema; the message names the key (bad input:
    exit 2, as every InputError)."""


def keyed_by(choice: Any, mapping: dict[str, Any]) -> dict[str, Any]:
    """`mapping` (choice -> implementation), checked at import to cover exactly the values of the
    Literal `choice`: the config's check is then the only check, and the two lists cannot drift."""
    allowed = typing.get_args(choice)
    if set(mapping) != set(allowed):
        raise TypeError(f"implementations {sorted(mapping)} do not match the config's choices {sorted(allowed)}")
    return mapping


def _apply(obj: Any, values: dict[str, Any], source: str, prefix: str = "") -> None:
    """Set `values` (a TOML table) on the dataclass `obj`, checking every key and value.

    `source` is the file or ``command line``; `prefix` the dotted key of `obj`, so errors read
    ``SOURCE: section.key ...``. A dataclass with a ``__post_init__`` check runs it again
    once its table is applied, so a file cannot set what the constructor would refuse.
    """
    hints = _hints(obj)
    names = set(hints)
    for key, value in values.items():
        dotted = f"{prefix}{key}"
        if key not in names:
            raise ConfigError(f"{source}: unknown key {dotted!r} (known: {', '.join(sorted(names))})")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"{source}: {dotted} must be a table")
            _apply(current, value, source, dotted + ".")
        else:
            setattr(obj, key, _coerce(value, hints[key], f"{source}: {dotted}"))
    post_init = getattr(obj, "__post_init__", None)
    if post_init is not None:
        try:
            post_init()
        except ValueError as exc:
            raise ConfigError(f"{source}: {prefix.rstrip('.')}: {exc}") from None


def _hints(obj: Any) -> dict[str, Any]:
    """Key -> type of every key of the config dataclass `obj`: its fields, then (a ModelConfig) the
    sections of encoders registered after its class (``ModelConfig.extra_sections``)."""
    hints = typing.get_type_hints(type(obj), include_extras=True)
    fields = {f.name: hints[f.name] for f in dataclasses.fields(obj)}
    extra = getattr(obj, "extra_sections", dict)()
    return {**fields, **{name: type(section) for name, section in extra.items()}}


def apply_table(obj: Any, values: dict[str, Any], source: str) -> None:
    """Set a TOML table on any typed config dataclass with this module's checks (unknown keys,
    Literal choices, types, ``__post_init__``), errors reading ``SOURCE: section.key ...``: the one
    loader of every command's typed config (also `freescale pipeline`'s, freescale/jobs/workflow/run.py)."""
    _apply(obj, values, source)


def _coerce(value: Any, hint: Any, where: str) -> Any:
    """`value` as the field's type; `where` is ``SOURCE: section.key`` for the error."""
    if typing.get_origin(hint) is Annotated:
        base, *marks = typing.get_args(hint)
        choices = [mark for mark in marks if isinstance(mark, OneOf)]
        hint = Literal[choices[0].values()] if choices else base
    if typing.get_origin(hint) is Literal:
        allowed = typing.get_args(hint)
        if value not in allowed:
            raise ConfigError(f"{where} must be one of {', '.join(map(repr, allowed))}, got {value!r}")
        return value
    target = hint if isinstance(hint, type) else None
    if target is None:  # e.g. `int | None`: take the first concrete type
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None:
            return None
        target = args[0] if args else str
    try:
        if target is bool:
            if isinstance(value, bool):
                return value
            if str(value).lower() in ("1", "true", "yes", "on"):
                return True
            if str(value).lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if target is int and isinstance(value, float) and not value.is_integer():
            raise ValueError(value)
        return target(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{where} must be a valid {target.__name__}, got {value!r}") from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> TrainConfig:
    """Defaults, then the TOML file, then `--section.key value` / `--section.key=value` overrides."""
    config = TrainConfig()
    if path:
        try:
            with open(path, "rb") as handle:
                _apply(config, _moved_table(tomllib.load(handle), str(path)), str(path))
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    for key, value in parse_overrides(overrides or []):
        key = MOVED_KEYS.get(key, key)
        section: dict[str, Any] = {}
        cursor = section
        parts = key.split(".")
        for part in parts[:-1]:
            cursor = cursor.setdefault(part, {})
        cursor[parts[-1]] = value
        _apply(config, section, "command line")
    return config


def _moved_table(table: dict[str, Any], source: str) -> dict[str, Any]:
    """A config file's table with every key of ``MOVED_KEYS`` at its new place."""
    for old, new in MOVED_KEYS.items():
        *old_path, old_key = old.split(".")
        parent = table
        for part in old_path:
            parent = parent.get(part) if isinstance(parent, dict) else None
        if not isinstance(parent, dict) or old_key not in parent:
            continue
        value = parent.pop(old_key)
        *new_path, new_key = new.split(".")
        target = table
        for part in new_path:
            target = target.setdefault(part, {})
        if new_key in target and target[new_key] != value:
            raise ConfigError(f"{source}: {old} (the old spelling of {new}) is {value!r} and {new} is "
                              f"{target[new_key]!r}: keep {new} only")
        target[new_key] = value
    return table


def moved_flat(flat: dict[str, Any]) -> dict[str, Any]:
    """A flat config (``to_flat_dict``'s, e.g. a checkpoint's record) with ``MOVED_KEYS`` renamed."""
    return {MOVED_KEYS.get(key, key): value for key, value in flat.items()}


def shape_keys(config: TrainConfig | None = None) -> tuple[str, ...]:
    """``section.key`` of every field marked ``shape`` (the registered encoders' sections included):
    the keys a checkpoint's tensors depend on."""
    return tuple(_shape_keys(config if config is not None else TrainConfig(), ""))


def _shape_keys(obj: Any, prefix: str) -> list[str]:
    keys = []
    marked = {f.name for f in dataclasses.fields(obj) if f.metadata.get(SHAPE)}
    for name in _hints(obj):
        value = getattr(obj, name)
        if dataclasses.is_dataclass(value):
            keys += _shape_keys(value, f"{prefix}{name}.")
        elif name in marked:
            keys.append(f"{prefix}{name}")
    return keys


def parse_overrides(argv: list[str]) -> list[tuple[str, str]]:
    pairs, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or "." not in arg:
            raise ConfigError(f"override {arg!r}: expected --section.key VALUE")
        if "=" in arg:
            key, value = arg[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(argv):
                raise ConfigError(f"override {arg!r} has no value")
            key, value = arg[2:], argv[i + 1]
            i += 2
        pairs.append((key.replace("-", "_"), value))
    return pairs


def to_flat_dict(config: Any, prefix: str = "") -> dict[str, Any]:
    """`section.key -> value` for every leaf: what MLflow records as the run's params."""
    flat: dict[str, Any] = {}
    for key in _hints(config):
        value = getattr(config, key)
        name = f"{prefix}{key}"
        if dataclasses.is_dataclass(value):
            flat.update(to_flat_dict(value, name + "."))
        else:
            flat[name] = value
    return flat
