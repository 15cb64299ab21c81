"""ModelInfer messages <-> the service's decoded request and output tensors.

The request becomes the same `codecs.InferRequest` that HTTP bodies decode to, so
`inputs.prepare` validates both protocols with the same rules and messages. Raw contents are
read as numpy views over the message's bytes (no copy); typed contents are copied once.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np

from service.grpc import grpc_service_pb2 as pb
from service.oip.codecs import MAX_RANK, InferRequest, InferTensor, OutputTensor, check_shape
from service.oip.datatypes import DATATYPES
from service.pipeline.errors import BadInput
from service.shm import BYTE_SIZE, REGION

if TYPE_CHECKING:
    from service.shm.tensors import SharedMemoryIO

# datatype -> the InferTensorContents field that carries it (FP16/BF16 only as raw bytes).
CONTENT_FIELDS = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
}


_PARAMETER_FIELDS = {bool: "bool_param", int: "int64_param", str: "string_param",
                     float: "double_param"}  # fmt: skip


def parameter_value(parameter: pb.InferParameter) -> Any:
    """The Python value of an InferParameter (bool, int, str or float); None when unset."""
    choice = parameter.WhichOneof("parameter_choice")
    return None if choice is None else getattr(parameter, choice)


def _parameters(parameters: Any) -> dict[str, Any]:
    return {key: parameter_value(value) for key, value in parameters.items()}


def _raw_array(name: str, datatype: str, shape: tuple[int, ...], count: int, raw: bytes):
    dtype = DATATYPES[datatype].numpy
    if len(raw) != count * dtype.itemsize:
        raise BadInput(
            f"input '{name}': raw_input_contents has {len(raw)} bytes but shape {list(shape)} "
            f"of {datatype} needs {count * dtype.itemsize}"
        )
    return np.frombuffer(raw, dtype=dtype)  # flat: reshaped once its dimensions are checked


def _typed_array(tensor: pb.ModelInferRequest.InferInputTensor, shape, count: int) -> np.ndarray:
    name, datatype = tensor.name, tensor.datatype
    field = CONTENT_FIELDS.get(datatype)
    if field is None:
        raise BadInput(
            f"input '{name}': {datatype} data travels only in raw_input_contents "
            "(InferTensorContents has no field for it)"
        )
    values = getattr(tensor.contents, field)
    if len(values) != count:
        raise BadInput(
            f"input '{name}': shape {list(shape)} needs {count} values, contents.{field} has "
            f"{len(values)}"
        )
    wide = {"BOOL": np.bool_, "FP32": np.float32, "FP64": np.float64}.get(datatype, np.int64)
    array = np.array(values, dtype=wide)
    if datatype not in ("BOOL", "FP32", "FP64"):
        dtype = DATATYPES[datatype].numpy
        info = np.iinfo(dtype)
        if array.size and (array.min() < info.min or array.max() > info.max):
            raise BadInput(f"input '{name}': contents.{field} holds values outside {datatype}")
        array = array.astype(dtype)
    return array  # flat: reshaped once its dimensions are checked


def in_shared_memory(request: pb.ModelInferRequest) -> bool:
    """Whether any input or output of `request` is in system shared memory."""
    return any(REGION in t.parameters for t in (*request.inputs, *request.outputs))


def shared_inputs(request: pb.ModelInferRequest) -> tuple[list[str], int]:
    """The regions its inputs in shared memory name, and the bytes they say they hold (what
    decoding copies)."""
    shared = [t for t in request.inputs if REGION in t.parameters]
    names = [t.parameters[REGION].string_param for t in shared]
    return names, sum(t.parameters[BYTE_SIZE].int64_param for t in shared)


def decode_infer_request(
    request: pb.ModelInferRequest, shm: SharedMemoryIO | None = None
) -> InferRequest:
    """The protobuf request as an InferRequest; raises BadInput naming the field at fault.
    Tensors in system shared memory are read (inputs) or checked (outputs) through `shm`."""
    if not request.inputs:
        raise BadInput("'inputs' must hold at least one tensor")
    raw = request.raw_input_contents
    in_messages = [t for t in request.inputs if REGION not in t.parameters]
    if raw and len(raw) != len(in_messages):
        raise BadInput(
            f"raw_input_contents has {len(raw)} entries for {len(in_messages)} inputs not in "
            "shared memory; send one per such input, in the order of 'inputs'"
        )
    inputs: dict[str, InferTensor] = {}
    message_bytes = request.ByteSize()  # what a dimension is checked against, as over HTTP
    index = 0  # the next raw_input_contents entry
    for tensor in request.inputs:
        name, datatype = tensor.name, tensor.datatype
        if name in inputs:
            raise BadInput(f"input '{name}' appears twice")
        if datatype not in DATATYPES:
            raise BadInput(f"input '{name}': datatype {datatype!r} is not supported here")
        if REGION in tensor.parameters:  # Triton's system shared memory (service.shm)
            if shm is None:
                raise BadInput(f"input '{name}': system shared memory is not offered here")
            if tensor.HasField("contents"):
                raise BadInput(f"input '{name}': send shared_memory_region or contents, not both")
            params = _parameters(tensor.parameters)
            array = shm.read_input(name, datatype, list(tensor.shape), params)
            inputs[name] = InferTensor(name, datatype, array.shape, array)
            continue
        shape = tuple(tensor.shape)
        if len(shape) > MAX_RANK or any(dim < 0 for dim in shape):
            raise BadInput(
                f"input '{name}': shape {list(shape)} must be at most {MAX_RANK} "
                "non-negative integers"
            )
        count = math.prod(shape)  # Python ints: no int64 wrap-around
        if raw:
            if tensor.HasField("contents"):
                raise BadInput(
                    f"input '{name}' has contents and raw_input_contents; send one of them"
                )
            array = _raw_array(name, datatype, shape, count, raw[index])
            index += 1
        else:
            array = _typed_array(tensor, shape, count)
        # The data matches the count; each dimension is still bounded like an HTTP body's (a
        # zero-size dimension beside huge ones matches any count of zero).
        check_shape(list(shape), name, message_bytes)
        array = array.reshape(shape)
        inputs[name] = InferTensor(name, datatype, shape, array)
    outputs = {}
    for output in request.outputs:
        # the flag only matters over HTTP: gRPC answers in raw or typed contents (see encode)
        outputs[output.name] = True
        if REGION in output.parameters and shm is not None:
            shm.want_output(output.name, _parameters(output.parameters))
    return InferRequest(request.id or None, _parameters(request.parameters), inputs, outputs, True)


def encode_infer_response(
    model_name: str,
    model_version: str,
    request_id: str,
    outputs: list[OutputTensor],
    raw: bool,
) -> pb.ModelInferResponse:
    """The response; tensors in raw_output_contents, or typed contents when `raw` is False and
    the datatype has a typed field (FP16/BF16 always go raw). An output in shared memory has an
    empty raw entry (Triton's C++ client reads raw_output_contents[i] for output i)."""
    response = pb.ModelInferResponse(model_name=model_name, model_version=model_version)
    response.id = request_id
    typed = not raw and all(t.datatype in CONTENT_FIELDS for t in outputs)
    for tensor in outputs:
        entry = response.outputs.add(name=tensor.name, datatype=tensor.datatype)
        entry.shape.extend(tensor.array.shape)
        if tensor.parameters is not None:  # written into shared memory: no contents
            for key, value in tensor.parameters.items():
                setattr(entry.parameters[key], _PARAMETER_FIELDS[type(value)], value)
            if not typed:  # an empty entry, as Triton sends: raw contents pair with outputs by
                response.raw_output_contents.append(b"")  # index (its C++ client needs one each)
        elif typed:
            getattr(entry.contents, CONTENT_FIELDS[tensor.datatype]).extend(
                tensor.array.reshape(-1).tolist()
            )
        else:
            response.raw_output_contents.append(np.ascontiguousarray(tensor.array).tobytes())
    return response
