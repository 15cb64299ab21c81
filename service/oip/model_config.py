"""What the protocols say about a served model: OIP metadata, Triton's model configuration,
and the extensions the server offers (HTTP and gRPC answer from these same dicts)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from service.oip.datatypes import of_torch
from service.oip.model_inputs import declared_inputs
from service.shm.cuda_regions import cuda_unavailable
from service.shm.regions import unavailable
from service.text.kinds import text_properties

if TYPE_CHECKING:
    from service.runtime.settings import Settings
    from service.runtime.state import ModelEntry

PLATFORM = "mha_engine"
# Triton extension names, offered over HTTP and gRPC alike (binary_tensor_data is HTTP's
# framing; gRPC carries raw_input_contents/raw_output_contents in the core protocol).
EXTENSIONS = ("binary_tensor_data", "model_configuration", "statistics")


def extensions(settings: Settings) -> list[str]:
    """The extensions offered: model_repository (index, load, unload) in explicit mode only;
    system_shared_memory where it works (one process, Linux), cuda_shared_memory where it works
    (one process, the engine on a CUDA device)."""
    explicit = settings.model_control_mode == "explicit"
    return [
        *EXTENSIONS,
        *(["model_repository"] if explicit else []),
        "logging",  # GET/POST /v2/logging, gRPC LogSettings
        "trace",  # GET/POST /v2[/models/{name}]/trace/setting, gRPC TraceSetting
        *(["system_shared_memory"] if unavailable(settings) is None else []),
        *(["cuda_shared_memory"] if cuda_unavailable(settings) is None else []),
    ]


def _tensors(entry: ModelEntry) -> tuple[list[tuple[str, str, int | None, bool]], str, int]:
    """(name, datatype, last dim or None for a mask, required) of each input the model is served
    with (service.oip.model_inputs); the output's datatype and width. int8 models take and give
    FP32 (their dtype is float32)."""
    datatype = of_torch(entry.model.dtype)
    inputs = [
        (i.name, "BOOL" if i.width is None else datatype, i.width, i.required)
        for i in declared_inputs(entry.limits)
    ]
    return inputs, datatype, entry.model.embed_dim


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
            tensor(name, dt, [-1, -1] if dim is None else [-1, -1, dim])
            for name, dt, dim, _ in inputs
        ],
        "outputs": [tensor("output", datatype, [-1, -1, width])],
        "properties": {
            **{k: str(v) for k, v in entry.info.items()},
            **text_properties(entry.model),
        },
    }


def model_config(entry: ModelEntry) -> dict[str, Any]:
    """Triton's model configuration (model_config.proto as JSON): dims leave out the batch
    dimension (max_batch_size > 0); `optional` marks what a request may leave out (masks; key and
    value where the query can serve as both); [T, E] or [B, T, E] both work."""
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
                "optional": not required,
            }
            for name, dt, dim, required in inputs
        ],
        "output": [{"name": "output", "data_type": f"TYPE_{datatype}", "dims": [-1, width]}],
        "instance_group": [
            {"name": entry.name, "kind": "KIND_GPU" if gpu else "KIND_CPU", "count": 1}
        ],
        "dynamic_batching": {
            "preferred_batch_size": [entry.batcher.max_batch_size],
            "max_queue_delay_microseconds": round(entry.batcher.max_batch_delay_s * 1e6),
        },
        "response_cache": {"enable": entry.cache_token is not None},
    }
