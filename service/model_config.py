"""What the protocols say about the served model: OIP metadata, Triton's model configuration,
and the extensions the server offers (HTTP and gRPC answer from these same dicts)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from service.app import ServiceState

MODEL_VERSION = "1"
PLATFORM = "mha_engine"
# Triton extension names, offered over HTTP and gRPC alike (binary_tensor_data is HTTP's
# framing; gRPC carries raw_input_contents/raw_output_contents in the core protocol).
EXTENSIONS = ("binary_tensor_data", "model_configuration", "statistics")
WIRE_DATATYPES = {"float32": "FP32", "bfloat16": "BF16", "float16": "FP16"}


def wire_datatype(state: ServiceState) -> str:
    """The OIP datatype of the model's floats (int8 models take and give FP32)."""
    return WIRE_DATATYPES[str(state.model.dtype).removeprefix("torch.")]


def _tensors(state: ServiceState) -> tuple[list[tuple[str, str, int | None]], int]:
    """(name, datatype, last dim or None for a mask) of each input, and the output's width."""
    model, datatype = state.model, wire_datatype(state)
    inputs: list[tuple[str, str, int | None]] = [("input", datatype, model.embed_dim)]
    if model.is_cross_attention_capable:
        inputs += [("key", datatype, model.kdim), ("value", datatype, model.vdim)]
    inputs.append(("key_padding_mask", "BOOL", None))
    return inputs, model.embed_dim


def model_metadata(state: ServiceState) -> dict[str, Any]:
    """OIP model metadata: inputs/outputs with datatypes and shapes (-1 = variable)."""
    inputs, width = _tensors(state)

    def tensor(name: str, datatype: str, shape: list[int]) -> dict[str, Any]:
        return {"name": name, "datatype": datatype, "shape": shape}

    return {
        "name": state.model_name,
        "versions": [MODEL_VERSION],
        "platform": PLATFORM,
        "inputs": [
            tensor(name, dt, [-1, -1] if dim is None else [-1, -1, dim]) for name, dt, dim in inputs
        ],
        "outputs": [tensor("output", wire_datatype(state), [-1, -1, width])],
        "properties": {k: str(v) for k, v in state.info.items()},
    }


def model_config(state: ServiceState) -> dict[str, Any]:
    """Triton's model configuration (model_config.proto as JSON): dims leave out the batch
    dimension (max_batch_size > 0); only `input` is required, [T, E] or [B, T, E] both work."""
    settings = state.settings
    inputs, width = _tensors(state)
    gpu = str(state.model.device).startswith("cuda")
    return {
        "name": state.model_name,
        "platform": PLATFORM,
        "backend": PLATFORM,
        "version_policy": {"latest": {"num_versions": 1}},
        "max_batch_size": settings.max_batch_size,
        "input": [
            {
                "name": name,
                "data_type": f"TYPE_{dt}",
                "format": "FORMAT_NONE",
                "dims": [-1] if dim is None else [-1, dim],
                "optional": name != "input",
            }
            for name, dt, dim in inputs
        ],
        "output": [
            {"name": "output", "data_type": f"TYPE_{wire_datatype(state)}", "dims": [-1, width]}
        ],
        "instance_group": [
            {"name": state.model_name, "kind": "KIND_GPU" if gpu else "KIND_CPU", "count": 1}
        ],
        "dynamic_batching": {
            "preferred_batch_size": [settings.max_batch_size],
            "max_queue_delay_microseconds": round(settings.max_batch_delay_ms * 1000),
        },
    }
