"""Copies between the host and a CUDA device on their own streams (--cuda-overlap): a batch's
inputs go up on one stream and the previous batch's outputs come down on another while the
compute stream runs, and the engine thread does not wait for a batch before staging the next.

Unverified on a GPU (written and tested on CPU hosts with torch.cuda stood in for): the GPU
tests run it with `MHA_TEST_CUDA_OVERLAP=1`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Download:
    """A batch's outputs on their way to pinned host memory; `wait()` returns them."""

    host: dict[str, torch.Tensor]  # wire datatype -> pinned (N, E) tensor
    total: torch.Tensor  # pinned 0-d float32: the sum of the output (NaN/Inf check)
    done: torch.cuda.Event

    def wait(self) -> tuple[dict[str, torch.Tensor], float]:
        """Block (without the GIL) until the copies are done: (host tensors, output sum)."""
        self.done.synchronize()
        return self.host, float(self.total)


class DeviceCopies:
    """Per engine thread: a stream for host->device and one for device->host copies. The
    compute stream (the thread's current stream) waits for each upload; each download waits
    for the compute queued before it. Tensors used on a stream other than the one they were
    allocated on are recorded there, so the caching allocator does not reuse them early."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.up = torch.cuda.Stream(device)
        self.down = torch.cuda.Stream(device)

    def upload(self, host: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
        """`host` (pinned) on the device in `dtype`, ready for what the compute stream runs next."""
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.up):
            on_device = host.to(device=self.device, dtype=dtype, non_blocking=True)
        compute.wait_stream(self.up)
        on_device.record_stream(compute)
        return on_device

    def download(self, outputs: dict[str, torch.Tensor], total: torch.Tensor) -> Download:
        """Each output (and `total`, a 0-d tensor) copied into pinned host memory after the
        compute queued so far; returns at once."""
        compute = torch.cuda.current_stream(self.device)
        self.down.wait_stream(compute)
        host: dict[str, torch.Tensor] = {}
        with torch.cuda.stream(self.down):
            for name, tensor in outputs.items():
                host[name] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                host[name].copy_(tensor, non_blocking=True)
                tensor.record_stream(self.down)
            total_host = torch.empty((), dtype=total.dtype, pin_memory=True)
            total_host.copy_(total, non_blocking=True)
            total.record_stream(self.down)
            done = torch.cuda.Event()
            done.record(self.down)
        return Download(host, total_host, done)
