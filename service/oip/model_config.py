"""What the protocols say about a served model: OIP metadata, Triton's model configuration,
and the extensions the server offers (HTTP and gRPC answer from these same dicts)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from service.oip.datatypes import of_torch
from service.oip.decoder_inputs import DECODER_ARCHITECTURES, input_names
from service.text.tokenizer import text_properties

if TYPE_CHECKING:
    from service.runtime.settings import Settings
    from service.runtime.state import ModelEntry

PLATFORM = "mha_engine"
# The inputs every request carries: an attention model's `input`, a decoder's tgt and memory /
# a transformer's src and tgt (PyTorch's names).
REQUIRED_INPUTS = frozenset({"input", "tgt", "memory", "src"})
# Triton extension names, offered over HTTP and gRPC alike (binary_tensor_data is HTTP's
# framing; gRPC carries raw_input_contents/raw_output_contents in the core protocol).
EXTENSIONS = ("binary_tensor_data", "model_configuration", "statistics")


def extensions(settings: Settings) -> list[str]:
    """The extensions offered: model_repository (index, load, unload) in explicit mode only."""
    explicit = settings.model_control_mode == "explicit"
    offered = [*EXTENSIONS, *(["model_repository"] if explicit else [])]
    offered.append("logging")  # GET/POST /v2/logging, gRPC LogSettings
    return offered


def _tensors(entry: ModelEntry) -> tuple[list[tuple[str, str, int | None]], str, int]:
    """(name, datatype, last dim or None for the mask) of each input; the output's datatype and
    width. int8 models take and give FP32 (their dtype is float32)."""
    model = entry.model
    datatype = of_torch(model.dtype)
    if model.architecture in DECODER_ARCHITECTURES:  # PyTorch's names: tgt, memory / src, tgt
        floats, masks = input_names(model.architecture)
        return (
            [(name, datatype, model.embed_dim) for name in floats]
            + [(name, "BOOL", None) for name in masks],
            datatype,
            model.embed_dim,
        )
    inputs: list[tuple[str, str, int | None]] = [("input", datatype, model.embed_dim)]
    if model.is_cross_attention_capable:
        inputs += [("key", datatype, model.kdim), ("value", datatype, model.vdim)]
    inputs.append(("key_padding_mask", "BOOL", None))
    return inputs, datatype, model.embed_dim


def model_metadata(entry: ModelEntry, versions: list[str]) -> dict[str, Any]:
    """OIP model metadata: the model's served `versions`, inputs/outputs with datatypes and
    shapes (-1 = variable)."""
    inputs, datatype, width = _tensors(entry)

    def tensor(name: str, dt: str, shape: list[int]) -> dict[str, Any]:
        return {"name": name, "datatype": dt, "shape": shape}

    return {
        "name": entry.name,
        "versions": versions,
        "platform": PLATFORM,
        "inputs": [
            tensor(name, dt, [-1, -1] if dim is None else [-1, -1, dim]) for name, dt, dim in inputs
        ],
        "outputs": [tensor("output", datatype, [-1, -1, width])],
        "properties": {
            **{k: str(v) for k, v in entry.info.items()},
            **text_properties(entry.model),
        },
    }


def model_config(entry: ModelEntry) -> dict[str, Any]:
    """Triton's model configuration (model_config.proto as JSON): dims leave out the batch
    dimension (max_batch_size > 0); only the float inputs (`input`, or a decoder's `tgt` and
    `memory` / `src`) are required, [T, E] or [B, T, E] both work."""
    inputs, datatype, width = _tensors(entry)
    gpu = str(entry.model.device).startswith("cuda")
    return {
        "name": entry.name,
        "platform": PLATFORM,
        "backend": PLATFORM,
        "version_policy": entry.version_policy,
        "max_batch_size": entry.batcher.max_batch_size,
        "input": [
            {
                "name": name,
                "data_type": f"TYPE_{dt}",
                "format": "FORMAT_NONE",
                "dims": [-1] if dim is None else [-1, dim],
                "optional": name not in REQUIRED_INPUTS,
            }
            for name, dt, dim in inputs
        ],
        "output": [{"name": "output", "data_type": f"TYPE_{datatype}", "dims": [-1, width]}],
        "instance_group": [
            {"name": entry.name, "kind": "KIND_GPU" if gpu else "KIND_CPU", "count": 1}
        ],
        "dynamic_batching": {
            "preferred_batch_size": [entry.batcher.max_batch_size],
            "max_queue_delay_microseconds": round(entry.batcher.max_batch_delay_s * 1e6),
        },
    }
