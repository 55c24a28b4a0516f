"""The encoder registry: every value ``model.encoder`` may take, what builds it and what it refuses.

A new encoder is its module (a ``freescale.training.model.encoders.Encoder`` and the config dataclass of its
section ``[model.<name>]``) plus one ``register_encoder`` line: below for the built-in ones, or in
the module that defines it (``docs/extending.md``). Registering declares the name and section to
the config (``freescale.training.config.declare_encoder_section``), which loads without importing this module,
torch or any encoder.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from freescale.training.config import ENCODERS as SECTIONS
from freescale.training.config import HSTUConfig, ModelConfig, SASRecConfig, declare_encoder_section
from freescale.training.model.attention_kernel import attention_kernel_for
from freescale.training.model.encoders import Encoder
from freescale.training.model.hstu import HSTUEncoder
from freescale.training.model.sasrec import SASRecEncoder


@dataclass(frozen=True)
class EncoderSpec:
    """One sequence encoder the model can be built with: the registry entry of ``model.encoder``'s
    value (``ENCODERS``). ``docs/extending.md`` says how to add one."""

    config: type
    """Dataclass of its section ``[model.<name>]``, built with no arguments for the defaults: a
    docstring per field, its own checks in ``__post_init__`` (``ValueError``), checks against the
    model's keys in an optional ``check_with(model)``, the fields that size its parameters marked
    ``shape(...)``, and a ``max_seq_len``, the longest history it is shaped for."""
    build: Callable[[ModelConfig], Any]
    """The model's config -> the encoder, a ``freescale.training.model.encoders.Encoder`` of width
    ``model.embedding_dim``. Called when a model is built; loading a config never calls it."""
    check: Callable[[ModelConfig, str], None] = lambda model, device_type: None
    """Refuses, in one line (an ``InputError``), a config the encoder cannot run on a device type
    (``"cpu"``, ``"cuda"``); ``freescale calibrate`` asks before it times anything. Default: none."""


# model.encoder -> its spec. Registration order is the order the choices are listed in.
ENCODERS: dict[str, EncoderSpec] = {}


def register_encoder(name: str, spec: EncoderSpec) -> None:
    """Make ``model.encoder = name`` build ``spec.build(model)``, shaped by ``[model.<name>]`` (a
    ``spec.config``). Configs made from then on carry the section (``ModelConfig.extra_sections``)."""
    if name in ENCODERS:
        raise ValueError(f"cannot register encoder {name!r}: taken (registered: {', '.join(ENCODERS)})")
    declare_encoder_section(name, spec.config)
    ENCODERS[name] = spec


def unregister_encoder(name: str) -> None:
    """Take ``name`` back out of the choices (a plugin's tests, between configs of their own)."""
    del ENCODERS[name]
    del SECTIONS[name]


def build_encoder(model: ModelConfig) -> Encoder:
    """``model.encoder``'s encoder of width ``model.embedding_dim``, from its registry entry."""
    encoder = ENCODERS[model.encoder].build(model)
    if not isinstance(encoder, Encoder):
        raise TypeError(f"encoder {model.encoder!r} built a {type(encoder).__name__}, not a freescale.training.model.encoders.Encoder")
    return encoder


def check_encoder(model: ModelConfig, device_type: str) -> None:
    """Refuse what the chosen encoder cannot run on ``device_type`` (``"cpu"``, ``"cuda"``), before
    any model or output exists: one line (its ``EncoderSpec.check``)."""
    ENCODERS[model.encoder].check(model, device_type)


register_encoder("hstu", EncoderSpec(
    HSTUConfig, lambda model: HSTUEncoder(model.hstu, model.embedding_dim, position_init_std=model.input_spread),
    lambda model, device_type: attention_kernel_for(model.hstu, device_type)))
register_encoder("sasrec", EncoderSpec(
    SASRecConfig, lambda model: SASRecEncoder(model.sasrec, model.embedding_dim, position_init_std=model.input_spread)))
