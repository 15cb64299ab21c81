"""The service's CUDA-only branches, run on a host without a GPU: torch.cuda patched, cuda device
strings and fake devices where a real tensor cannot exist. The server once died at start on
CUDA with a NameError no CPU test executed (metrics used `torch`, imported only for typing);
these tests and the static check below keep that class of defect out."""

from __future__ import annotations

import ast
import asyncio
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import mha_engine
from benchmarks.server import ROOT
from service.runtime import forward
from service.runtime.loading import model_info
from service.runtime.metrics import MODEL_INFO_LABELS, Metrics

PACKAGES = ("service", "mha_engine")


def _type_checking_names(tree: ast.Module) -> set[str]:
    """Names a module binds only under `if TYPE_CHECKING:`."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for stmt in ast.walk(node):
                if isinstance(stmt, ast.Import | ast.ImportFrom):
                    names |= {(a.asname or a.name).split(".")[0] for a in stmt.names}
    return names


def _runtime_uses(tree: ast.Module, names: set[str]) -> list[int]:
    """Lines that load one of `names` at run time: outside annotations, and in no function that
    imports the name itself."""
    annotations: set[int] = set()
    for node in ast.walk(tree):
        parts = []
        if isinstance(node, ast.arg | ast.AnnAssign) and node.annotation is not None:
            parts.append(node.annotation)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.returns is not None:
            parts.append(node.returns)
        annotations |= {id(n) for part in parts for n in ast.walk(part)}
    shielded: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            local = {
                (a.asname or a.name).split(".")[0]
                for stmt in ast.walk(node)
                if isinstance(stmt, ast.Import | ast.ImportFrom)
                for a in stmt.names
            }
            if local & names:
                shielded |= {id(n) for n in ast.walk(node)}
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Name)
        and isinstance(node.ctx, ast.Load)
        and node.id in names
        and id(node) not in annotations
        and id(node) not in shielded
    ]


def test_static_check_finds_the_startup_crash_pattern():
    """The check below would have caught the NameError in set_model_info."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import torch\n"
        "def f(d: torch.device) -> None:\n    return torch.cuda.is_available()\n"
        "def g(d: torch.device) -> None:\n    import torch\n    return torch.cuda\n"
    )
    tree = ast.parse(source)
    assert _runtime_uses(tree, _type_checking_names(tree)) == [5]


def test_no_typing_only_import_is_used_at_run_time():
    """A name imported under TYPE_CHECKING and read at run time is a NameError waiting for the
    branch that reads it (often a CUDA-only one)."""
    found = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if path.name.endswith("_pb2.py") or path.name.endswith("_pb2_grpc.py"):
                continue
            tree = ast.parse(path.read_text(), str(path))
            names = _type_checking_names(tree)
            if names:
                found += [f"{path.relative_to(ROOT)}:{n}" for n in _runtime_uses(tree, names)]
    assert found == []


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """torch.cuda as on a one-GPU host, with memory counters the test controls."""
    memory = {"allocated": 123_456, "reserved": 2_097_152}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: memory["allocated"])
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: memory["reserved"])
    return memory


def test_model_info_on_cuda_adds_memory_gauges(fake_gpu):
    """set_model_info with a CUDA device: mha_model_info and both memory gauges, read at scrape
    time (the start-up path that crashed on an H100)."""
    model = mha_engine.build_demo_model(device="cpu")
    info = {**model_info(model, "mha"), "device": "cuda:0"}
    assert set(info) == set(MODEL_INFO_LABELS)
    metrics = Metrics("mha", "1")
    metrics.set_model_info(info)
    text = _exposition(metrics)
    labels = 'device="cuda:0",model="mha",version="1"'
    assert f"mha_cuda_memory_allocated_bytes{{{labels}}} 123456.0" in text
    assert f"mha_cuda_memory_reserved_bytes{{{labels}}} 2.097152e+06" in text
    fake_gpu["allocated"] = 7
    assert f"mha_cuda_memory_allocated_bytes{{{labels}}} 7.0" in _exposition(metrics)
    assert 'device="cuda:0"' in next(
        line for line in text.splitlines() if line.startswith("mha_model_info{")
    )


def _exposition(metrics: Metrics) -> str:
    return metrics.exposition()[0].decode()


def test_model_info_on_cuda_without_a_visible_gpu_adds_no_gauges(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    metrics = Metrics("mha", "1")
    model = mha_engine.build_demo_model(device="cpu")
    metrics.set_model_info({**model_info(model, "mha"), "device": "cuda:0"})
    assert "mha_cuda_memory" not in _exposition(metrics)


def test_cuda_engine_gauges_read_the_model_at_scrape_time(fake_gpu):
    """set_cuda_engine: graphs, their memory and grouped-SDPA forwards, per model version."""

    class Graphs:  # what the gauges read from mha_engine's CudaGraphs
        count, memory_bytes = 3, 4096

    graphs = Graphs()
    metrics = Metrics("mha", "1")
    model = mha_engine.build_demo_model(device="cpu")
    metrics.set_model_info({**model_info(model, "mha"), "device": "cuda:0"})
    model.cuda_graphs = graphs
    metrics.set_cuda_engine(model)
    text = _exposition(metrics)
    assert 'mha_cuda_graphs{model="mha",version="1"} 3.0' in text
    assert 'mha_cuda_graph_memory_bytes{model="mha",version="1"} 4096.0' in text
    assert 'mha_cuda_grouped_calls{model="mha",version="1"} 0.0' in text
    graphs.count = 5
    model.attention_layers()[0].cuda_grouped_calls = 2
    text = _exposition(metrics)
    assert 'mha_cuda_graphs{model="mha",version="1"} 5.0' in text
    assert 'mha_cuda_grouped_calls{model="mha",version="1"} 2.0' in text
    metrics.remove_state_series()  # an unload drops them with the other state gauges
    assert "mha_cuda_graphs{" not in _exposition(metrics)


def test_loading_on_cuda_captures_graphs_or_says_why_not(monkeypatch, caplog):
    """load_served_model on a CUDA model calls enable_cuda_graphs with the settings' bounds (a
    power-of-two token bucket); where the model refuses, it logs why and serves eagerly."""
    from service.runtime import loading
    from service.runtime.settings import Settings

    calls = []

    def enable(self, **kwargs):
        calls.append(kwargs)
        raise ValueError("no replayable layers here")

    cuda = property(lambda self: torch.device("cuda"))
    monkeypatch.setattr(mha_engine.models.EngineModel, "device", cuda)
    monkeypatch.setattr(mha_engine.models.EngineModel, "enable_cuda_graphs", enable)
    settings = Settings(cuda_graph_max_tokens=3000, max_batch_size=8, max_seq_len=100)
    with caplog.at_level("INFO", logger="service.runtime.loading"):
        model = loading.load_served_model(settings, None)
    assert isinstance(model, mha_engine.models.EngineModel)  # served eagerly
    assert calls == [{"max_tokens": 2048, "max_sequences": 8, "warm_max_len": 100}]
    assert "CUDA graphs off for this model: no replayable layers here" in caplog.text
    loading.load_served_model(Settings(cuda_graphs=False), None)
    assert len(calls) == 1  # --no-cuda-graphs: never asked


def test_stage_pins_host_memory_and_copies_without_blocking_for_cuda(monkeypatch):
    """forward.stage for a CUDA model: a pinned staging tensor and one non-blocking copy to the
    device. CPU torch has neither pinned memory nor CUDA tensors, so both calls are recorded
    and carried out on the CPU."""
    calls: dict[str, object] = {}
    real_empty, real_to = torch.empty, torch.Tensor.to

    def empty(*args, pin_memory=False, **kwargs):
        calls["pin_memory"] = pin_memory
        return real_empty(*args, **kwargs)

    def to(self, *args, device=None, non_blocking=False, **kwargs):
        if device is not None and torch.device(device).type == "cuda":
            calls["device"], calls["non_blocking"] = str(device), non_blocking
            device = "cpu"
        return real_to(self, *args, device=device, non_blocking=non_blocking, **kwargs)

    monkeypatch.setattr(forward.torch, "empty", empty)
    monkeypatch.setattr(torch.Tensor, "to", to)
    arrays = [np.arange(8, dtype=np.float32).reshape(2, 4), np.ones((3, 4), np.float32)]
    staging, on_device = forward.stage(arrays, ["FP32", "FP32"], torch.device("cuda:0"), None)
    assert calls == {"pin_memory": True, "device": "cuda:0", "non_blocking": True}
    assert torch.equal(on_device, torch.from_numpy(np.concatenate(arrays)))
    assert staging.shape == (5, 4)


# Why no CUDA here: a CPU build of torch (CI's) has none; a CUDA build on a host without a GPU
# (the GPU machines' torch, tried here) sees no device.
NO_CUDA_HERE = "this torch build" if torch.version.cuda is None else "no CUDA device is visible"


def test_bad_device_at_start_is_one_line_and_exit_2(tmp_path: Path):
    """`--device cudaX`, `--device cuda:7` here (no CUDA), `--device cuda --dtype int8`, and a
    bad device in a model's mha-serve.json: one line naming the flag or file, exit 2, before
    any model loads."""
    repo = tmp_path / "repo"
    mha_engine.save_model(torch.nn.MultiheadAttention(8, 2, batch_first=True), repo / "m" / "1")
    (repo / "m" / "mha-serve.json").write_text('{"device": "cuda:3"}')
    cases = [
        (["--device", "cudaX"], "--device / --dtype (MHA_DEVICE / MHA_DTYPE): 'cudaX' is not a"),
        (["--device", "cuda:7"], f"cuda:7 was asked for, but {NO_CUDA_HERE}"),
        (["--device", "cuda", "--dtype", "int8"], "--device / --dtype"),
        (["--model-repository", str(repo)], "model 'm' mha-serve.json (device): cuda:3"),
    ]
    starts = [  # all at once: each spends seconds importing torch
        subprocess.Popen(
            [sys.executable, "-m", "service", "--port", "0", "--grpc-port", "0", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        for args, _ in cases
    ]
    try:
        ends = [start.communicate(timeout=90) for start in starts]
    finally:
        for start in starts:
            start.kill()  # a no-op for those that exited
    for (args, expected), start, (_, stderr) in zip(cases, starts, ends, strict=True):
        lines = stderr.strip().splitlines()
        assert start.returncode == 2, (args, stderr)
        assert len(lines) == 1 and lines[0].startswith("mha-serve: error: "), stderr
        assert expected in lines[0], (expected, lines[0])


def test_cuda_models_keep_every_batch_on_the_engine_thread(fake_gpu, monkeypatch):
    """--loop-batch-max-ms is for CPU models: a CUDA model's batcher gets no loop placement (a
    batch on the loop would wait for the device there); the same model on the CPU gets one."""
    from service.runtime import loading
    from service.runtime.repository import model_sources
    from service.runtime.settings import Settings

    settings = Settings(loop_batch_max_ms=2.0, device="cpu")  # built on the CPU either way
    (source,) = model_sources(settings)
    cpu_entry = asyncio.run(loading.load_entry(settings, Metrics("mha", "1"), source))
    assert cpu_entry.batcher._placement is not None

    def no_graphs(self, **kwargs):
        raise ValueError("not on this host")

    cuda = property(lambda self: torch.device("cuda"))
    monkeypatch.setattr(mha_engine.models.EngineModel, "device", cuda)
    monkeypatch.setattr(mha_engine.models.EngineModel, "enable_cuda_graphs", no_graphs)
    monkeypatch.setattr(mha_engine.introspect, "sdpa_backend", lambda *args, **kwargs: "flash")
    cuda_entry = asyncio.run(loading.load_entry(settings, Metrics("mha", "1"), source))
    assert cuda_entry.model.device.type == "cuda"
    assert cuda_entry.batcher._placement is None
