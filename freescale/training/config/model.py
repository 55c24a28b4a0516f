"""``[model]`` and its encoders' sections (``[model.hstu]``, ``[model.sasrec]``, and those of encoders
registered later): the recommender's width, inputs, scores and negatives, and each encoder's shape."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Annotated, Any

from freescale.runtime.typed_config import OneOf, check_choices
from freescale.training.config.choices import AttentionActivation, AttentionKernel, AttentionNormalization, HSTUInit, shape


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
        check_choices(self, ("attention_normalization", "attention_activation", "attention_kernel", "init"))
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

