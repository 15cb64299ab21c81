"""The CUDA-only gauges of one metrics registry, read at scrape time: device memory per model
version, and the engine's CUDA graphs and grouped-SDPA fallbacks (mha_engine.cuda_graphs,
mha_engine.varlen). torch is imported where a gauge is added: the --workers supervisor has none.
With multiprocess metrics none are exposed (the scrape does not reach the engine process)."""

from __future__ import annotations

import functools
import logging
from typing import Any

from prometheus_client import CollectorRegistry, Gauge

log = logging.getLogger(__name__)
LABELS = ["model", "version"]


class CudaGauges:
    """Created once per registry and shared by every model's Metrics view."""

    def __init__(self, registry: CollectorRegistry, multiprocess: bool) -> None:
        self.registry, self.multiprocess = registry, multiprocess
        self._gauges: dict[str, Gauge] = {}

    def families(self) -> list[Gauge]:
        """The families created so far (what an unload removes its series from)."""
        return list(self._gauges.values())

    def _gauge(self, key: str, name: str, doc: str, labels: list[str]) -> Gauge:
        if key not in self._gauges:
            self._gauges[key] = Gauge(name, doc, labels, registry=self.registry)
        return self._gauges[key]

    def add_memory(self, model: str, version: str, device_name: str) -> None:
        """torch.cuda.memory_allocated/reserved of the model's device; nothing where CUDA is
        not available (test_cuda_branches runs this on CPU with torch.cuda patched)."""
        import torch

        if not torch.cuda.is_available():
            return
        if self.multiprocess:
            _skipped()
            return
        device = torch.device(device_name)
        labels = [*LABELS, "device"]
        allocated = self._gauge(
            "allocated", "mha_cuda_memory_allocated_bytes",
            "torch.cuda.memory_allocated() of the device.", labels,
        )  # fmt: skip
        reserved = self._gauge(
            "reserved", "mha_cuda_memory_reserved_bytes",
            "torch.cuda.memory_reserved() of the device.", labels,
        )  # fmt: skip
        allocated.labels(model, version, str(device)).set_function(
            lambda: torch.cuda.memory_allocated(device)
        )
        reserved.labels(model, version, str(device)).set_function(
            lambda: torch.cuda.memory_reserved(device)
        )

    def add_engine(self, model: str, version: str, engine_model: Any) -> None:
        """mha_cuda_grouped_calls (forwards where an attention layer could not take the varlen
        kernel) and, with --cuda-graphs, mha_cuda_graphs and mha_cuda_graph_memory_bytes."""
        if self.multiprocess:
            return
        grouped = self._gauge(
            "grouped", "mha_cuda_grouped_calls", "CUDA forwards in which an attention layer "
            "took grouped SDPA (masks, mixed causal flags, fp32 GQA), not the varlen kernel.",
            LABELS,
        )  # fmt: skip
        graphs = self._gauge(
            "graphs", "mha_cuda_graphs", "CUDA graphs captured for the model (--cuda-graphs).",
            LABELS,
        )  # fmt: skip
        memory = self._gauge(
            "graph_memory", "mha_cuda_graph_memory_bytes",
            "GPU memory the model's CUDA graphs hold.", LABELS,
        )  # fmt: skip
        grouped.labels(model, version).set_function(lambda: engine_model.cuda_grouped_calls)
        held = getattr(engine_model, "cuda_graphs", None)
        graphs.labels(model, version).set_function(lambda: held.count if held else 0)
        memory.labels(model, version).set_function(lambda: held.memory_bytes if held else 0)


@functools.cache
def _skipped() -> None:
    """Say once per process why the CUDA memory gauges are missing."""
    log.warning(
        "multiprocess metrics: mha_cuda_memory_* gauges are not exposed (they are read at "
        "scrape time, in a process the scrape does not reach)"
    )
