"""CheckpointError and the checks every loader uses, so errors name the field, key and shapes."""

from __future__ import annotations

import torch
from torch import Tensor


class CheckpointError(ValueError):
    """A model directory whose config or weights cannot give a correct model."""


def positive_int(config: dict, name: str, default: int | None = None) -> int:
    """config[name] (`default` where it is absent or null) as a positive int, else
    CheckpointError naming the field."""
    value = config.get(name)
    value = default if value is None else value
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise CheckpointError(f"config.{name} must be a positive integer, got {value!r}")
    return value


def positive_number(config: dict, name: str, default: float | None = None) -> float:
    """config[name] (`default` where it is absent) as a positive float, else CheckpointError
    naming the field."""
    value = config.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise CheckpointError(f"config.{name} must be a positive number, got {value!r}")
    return float(value)


def check_state(
    state: dict,
    expected: dict[str, tuple[int, ...]],
    source: str,
    optional: dict[str, tuple[int, ...]] | None = None,
) -> None:
    """Raise CheckpointError for missing/unexpected keys, wrong shapes or non-float tensors.

    `expected` keys must all be present, `optional` ones may be; `source` names what the shapes
    come from ("bert config", "attention layout W_q/W_k/W_v/W_o"), quoted in every message.
    """
    optional = optional or {}
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected) - set(optional))
    if missing or unexpected:
        raise CheckpointError(
            f"state dict does not match the {source}: "
            f"missing keys {missing}, unexpected keys {unexpected}"
        )
    for key, shape in {**expected, **optional}.items():
        if key not in state:
            continue
        tensor = state[key]
        if not isinstance(tensor, Tensor):
            raise CheckpointError(f"{key}: expected a tensor, got {type(tensor).__name__}")
        if not torch.is_floating_point(tensor):
            raise CheckpointError(f"{key}: expected a floating point tensor, got {tensor.dtype}")
        if tuple(tensor.shape) != shape:
            raise CheckpointError(
                f"{key}: expected shape {shape}, got {tuple(tensor.shape)} (from the {source})"
            )


class DeviceError(ValueError):
    """A device, or a dtype on a device, that this host or torch build cannot run; the message
    says what would."""
