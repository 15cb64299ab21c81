"""RoPE's fields of a Hugging Face config.json in engine terms: each layer kind's base
(rope_theta) and static scaling (text_config.RopeScaling), from either form, as transformers 5
reads them: `rope_parameters` (one entry, or one per layer kind), or transformers 4's
`rope_theta` and `rope_scaling` (which wins over rope_parameters). `hf_entry` writes one entry
back (save_model).

Refused naming the field: the kinds whose frequencies change with the input's length (dynamic,
longrope: a sequence's numbers would depend on its batch-mates), partial rotary factors, and
scaling where the family has none. `ntk` (fixed NTK) is read only where the family's own code
defines it (GTE).
"""

from __future__ import annotations

import math
from dataclasses import fields

from .errors import CheckpointError
from .text_config import RopeScaling

DEFAULT = "default"
BY_LENGTH = ("dynamic", "longrope")  # frequencies chosen by the batch's length
TRANSFORMERS_KINDS = ("linear", "llama3", "yarn")  # the static kinds transformers computes
NTK = "ntk"  # GTE's fixed NTK (gte-*-en-v1.5's remote code; not a transformers kind)


def _mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention scale for a factor (transformers' get_mscale)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def entry(
    rope: object,
    config: dict,
    where: str,
    theta: float,
    scalable: bool = True,
    nested: bool = False,
    kinds: tuple[str, ...] = TRANSFORMERS_KINDS,
) -> tuple[float, RopeScaling | None]:
    """(base, scaling or None) of one RoPE entry `rope` found at config.<where>; its base is
    `theta` when it names none. scalable=False: only plain RoPE is accepted there. nested: an
    entry of a per-kind rope_parameters, where transformers takes the pre-training length only
    from the entry or the position table and always truncates YaRN's ramp. kinds: the scalings
    the family runs."""
    if not isinstance(rope, dict):
        raise CheckpointError(f"config.{where} must be an object, got {rope!r}")
    kind = rope.get("rope_type", rope.get("type", DEFAULT))
    base = rope.get("rope_theta", theta)
    for fields_ in (rope, config):  # transformers moves a top-level one into the entry
        if fields_.get("partial_rotary_factor", 1.0) != 1.0:
            raise CheckpointError("config.partial_rotary_factor is not supported (only 1.0)")
    if kind == DEFAULT:
        return base, None
    if kind in BY_LENGTH and scalable:
        raise CheckpointError(
            f"config.{where}.rope_type {kind!r} is not supported: it chooses the frequencies by "
            "the input's length, so a sequence's numbers would depend on its batch-mates "
            f"(supported: {DEFAULT!r}, {', '.join(map(repr, kinds))})"
        )
    if kind not in kinds or not scalable:
        only = (DEFAULT, *kinds) if scalable else (DEFAULT,)
        raise CheckpointError(
            f"config.{where}.rope_type {kind!r} is not supported here (only "
            f"{', '.join(map(repr, only))})"
        )
    factor = rope.get("factor")
    # transformers' standardize_rope_params: a top-level field wins (Phi-3's form; not for a
    # per-kind entry), else the entry's, else the position table
    positions = config.get("max_position_embeddings")
    original = (
        (None if nested else config.get("original_max_position_embeddings"))
        or rope.get("original_max_position_embeddings")
        or positions
    )
    if kind == "linear":
        return base, RopeScaling(kind, factor)
    if kind == NTK:
        if rope.get("mixed_b") is not None:
            raise CheckpointError(
                f"config.{where}.mixed_b (mixed NTK) is not supported: only fixed NTK scaling"
            )
        if isinstance(factor, int | float) and not isinstance(factor, bool) and factor < 1:
            raise CheckpointError(  # GTE's code scales only past max_position_embeddings then
                f"config.{where}.factor {factor!r} < 1: GTE's NTK scaling then depends on the "
                "input's length (a sequence's numbers would depend on its batch-mates)"
            )
        return base, RopeScaling(kind, factor)
    if kind == "llama3":
        return base, RopeScaling(
            kind,
            factor,
            original_max_position_embeddings=original,
            low_freq_factor=rope.get("low_freq_factor"),
            high_freq_factor=rope.get("high_freq_factor"),
        )
    if factor is None:  # yarn: the ratio of the position table to the pre-training length
        if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0
                   for n in (positions, original)):  # fmt: skip
            raise CheckpointError(
                f"config.{where}.factor is null: YaRN's factor is then max_position_embeddings / "
                f"original_max_position_embeddings, which need to be positive integers (got "
                f"{positions!r}, {original!r})"
            )
        factor = positions / original
    attention = rope.get("attention_factor")
    if attention is None and isinstance(factor, int | float) and factor > 0:
        mscale, all_dims = rope.get("mscale"), rope.get("mscale_all_dim")
        if not (mscale and all_dims):
            attention = _mscale(factor)
        elif all(isinstance(v, int | float) for v in (mscale, all_dims)):
            attention = _mscale(factor, mscale) / _mscale(factor, all_dims)
        else:
            raise CheckpointError(
                f"config.{where}.mscale and mscale_all_dim must be numbers, got {mscale!r} and "
                f"{all_dims!r}"
            )
    return base, RopeScaling(
        kind,
        factor,
        original_max_position_embeddings=original,
        beta_fast=rope.get("beta_fast") or 32.0,
        beta_slow=rope.get("beta_slow") or 1.0,
        attention_factor=float(attention) if isinstance(attention, int | float) else attention,
        truncate=True if nested else rope.get("truncate", True),
    )


def single(
    config: dict, default: float, kinds: tuple[str, ...] = TRANSFORMERS_KINDS
) -> tuple[float, RopeScaling | None]:
    """One RoPE for every layer (Qwen3, the Llama family): rope_scaling, else rope_parameters,
    else plain RoPE with base config.rope_theta (`default` when absent)."""
    theta = config.get("rope_theta", default)
    where = "rope_scaling" if config.get("rope_scaling") else "rope_parameters"
    rope = config.get(where)
    return (theta, None) if rope is None else entry(rope, config, where, theta, kinds=kinds)


def per_kind(
    config: dict, kind: str, legacy: str, default: float, scaled_by_legacy: bool
) -> tuple[float, RopeScaling | None]:
    """One layer kind's RoPE (ModernBERT, Gemma 3): rope_parameters[kind], its base else the
    config's `legacy` field else `default`. transformers 4's rope_scaling is merged into this
    kind's entry when `scaled_by_legacy` (Gemma 3's full layers) and ignored otherwise; scaling
    is accepted only where it is merged."""
    theta = config.get(legacy, default)
    params = config.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise CheckpointError(f"config.rope_parameters must be an object, got {params!r}")
    rope = None if params is None else params.get(kind)
    legacy_scaling = config.get("rope_scaling")
    if legacy_scaling and scaled_by_legacy:
        if not isinstance(legacy_scaling, dict):
            raise CheckpointError(f"config.rope_scaling must be an object, got {legacy_scaling!r}")
        rope = {**(rope if isinstance(rope, dict) else {}), **legacy_scaling}
    if rope is None:
        return theta, None
    where = f"rope_parameters.{kind}"
    return entry(rope, config, where, theta, scalable=scaled_by_legacy, nested=True)


def hf_entry(theta: float, scaling: RopeScaling | None) -> dict:
    """One rope_parameters entry as transformers 5 writes it (inverse of `entry`)."""
    if scaling is None:
        return {"rope_type": DEFAULT, "rope_theta": theta}
    keep = {
        "linear": ("factor",),  # fixed NTK is written in this form (rope.transformers_form)
        "llama3": ("factor", "original_max_position_embeddings", "low_freq_factor",
                   "high_freq_factor"),
        "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                 "attention_factor", "truncate"),
    }[scaling.rope_type]  # fmt: skip
    values = {f.name: getattr(scaling, f.name) for f in fields(scaling) if f.name in keep}
    return {"rope_type": scaling.rope_type, "rope_theta": theta, **values}
