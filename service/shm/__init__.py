"""Triton's shared-memory extensions: clients on the same host register POSIX shared-memory
regions (regions) or, where the engine runs on a GPU, CUDA buffers by their IPC handles
(cuda_regions), and requests read inputs from / write outputs into them (tensors)."""

# The tensor parameters that put an input or output in a region (Triton's names).
REGION = "shared_memory_region"
OFFSET = "shared_memory_offset"
BYTE_SIZE = "shared_memory_byte_size"
