"""The inputs a served model takes: one list for what the protocols declare (OIP metadata,
Triton's model configuration) and what a request may send. A model served with
`optional_inputs` false (a model setting) declares only its required inputs, for Triton tools
that refuse optional ones (perf_analyzer --shared-memory system), and refuses the others."""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING

from service.oip.decoder_inputs import DECODER_ARCHITECTURES, input_names
from service.pipeline.errors import BadInput

if TYPE_CHECKING:
    from service.oip.inputs import ModelLimits


@dataclass(frozen=True)
class ModelInput:
    """One input: PyTorch's name, its last dimension and whether every request carries it."""

    name: str
    width: int | None  # a float input's last dimension ([B, T, width]); None: a BOOL mask [B, T]
    required: bool


def all_inputs(limits: ModelLimits) -> list[ModelInput]:
    """Every input the model can take, in the order metadata lists them (PyTorch's names)."""
    if limits.architecture in DECODER_ARCHITECTURES:  # tgt, memory / src, tgt; then masks
        floats, masks = input_names(limits.architecture)
        return [ModelInput(name, limits.embed_dim, True) for name in floats] + [
            ModelInput(name, None, False) for name in masks
        ]
    inputs = [ModelInput("input", limits.embed_dim, True)]
    if limits.cross_attention:  # required where the query cannot serve as key and value
        both = limits.needs_key_value
        inputs += [ModelInput("key", limits.kdim, both), ModelInput("value", limits.vdim, both)]
    inputs.append(ModelInput("key_padding_mask", None, False))
    return inputs


def declared_inputs(limits: ModelLimits) -> list[ModelInput]:
    """The inputs the model is served with: all, or the required ones (optional_inputs false)."""
    return [i for i in all_inputs(limits) if i.required or limits.optional_inputs]


@functools.lru_cache(maxsize=64)
def _declared_names(
    architecture: str, cross_attention: bool, needs_key_value: bool, optional_inputs: bool
) -> frozenset[str]:
    """The names declared_inputs gives a model of this kind (all it depends on)."""
    limits = SimpleNamespace(
        architecture=architecture,
        cross_attention=cross_attention,
        needs_key_value=needs_key_value,
        optional_inputs=optional_inputs,
        embed_dim=None,
        kdim=None,
        vdim=None,
    )
    return frozenset(i.name for i in declared_inputs(limits))  # type: ignore[arg-type]


def check_input_names(names: Iterable[str], limits: ModelLimits, model: str = "model") -> None:
    """BadInput naming any input the model is not served with (`model`: how to call it)."""
    sent = set(names)
    key = (limits.architecture, limits.cross_attention, limits.needs_key_value)
    if _declared_names(*key, limits.optional_inputs).issuperset(sent):
        return  # every request runs this: the names are worked out once per kind of model
    declared = [i.name for i in declared_inputs(limits)]
    hidden = sorted(sent & {i.name for i in all_inputs(limits)} - set(declared))
    if hidden:
        raise BadInput(
            f"input(s) {hidden} not accepted: this {model} is served with optional_inputs "
            f"false and takes only {declared}"
        )
    unknown = sorted(sent - set(declared))
    if unknown:
        raise BadInput(f"unknown input(s) {unknown}; this {model} takes {sorted(declared)}")
