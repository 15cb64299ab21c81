"""Triton's system shared-memory extension: clients on the same host register POSIX shared-memory
regions (regions) and requests read inputs from / write outputs into them (tensors)."""

# The tensor parameters that put an input or output in a region (Triton's names).
REGION = "shared_memory_region"
OFFSET = "shared_memory_offset"
BYTE_SIZE = "shared_memory_byte_size"
