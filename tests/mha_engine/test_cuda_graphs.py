"""CUDA graphs on the CPU: the bucket a batch gets, the padded cu_seqlens it replays with, the
refusals (no CUDA device, layers that cannot replay), and CudaGraphs' replay protocol (static
buffers, the double-buffered cu_seqlens upload, causal buckets) with the capture stood in for by
a recording that re-runs the captured call on the static buffers. The real replays run on a GPU
in tests/gpu/test_gpu_engine.py."""

from __future__ import annotations

import contextlib
from itertools import pairwise

import pytest
import torch

import mha_engine.cuda_graphs as cuda_graphs
from mha_engine.checkpoint import model_from_state_dict
from mha_engine.cuda_graphs import (
    CudaGraphs,
    _cu_seqlens,
    bucket,
    bucket_key,
    bucket_slots,
    graph_mode,
)
from mha_engine.save import module_config, module_state
from mha_engine.varlen import cumulative


@pytest.mark.parametrize(("n", "want"), [(0, 16), (1, 16), (16, 16), (17, 32), (1000, 1024)])
def test_bucket_is_the_next_power_of_two_from_16(n, want):
    assert bucket(n) == want


def test_bucket_key_takes_tokens_and_longest_sequence():
    assert bucket_key([5, 9], 4096, 32) == (16, 16)
    assert bucket_key([300, 20], 4096, 32) == (512, 512)
    assert bucket_key([40] * 20, 4096, 32) == (1024, 64)
    assert bucket_key([5000], 4096, 32) is None  # past the largest bucket: eager
    assert bucket_key([1] * 33, 4096, 32) is None  # past max_sequences
    assert bucket_key([], 4096, 32) is None


def test_padding_rows_form_their_own_sequences_and_slots_stay_empty():
    lens = [3, 7, 1]
    tokens, max_len = bucket_key(lens, 4096, 8)
    slots = bucket_slots(tokens, max_len, 8)
    cu = _cu_seqlens(lens, tokens, max_len, slots)
    assert len(cu) == slots + 1
    assert cu[:4] == [0, 3, 10, 11]  # the real sequences, unchanged
    chunks = [b - a for a, b in pairwise(cu[3:]) if b > a]
    assert sum(chunks) == tokens - 11 and max(chunks) <= max_len  # padding, never longer
    assert cu[-1] == tokens and all(a <= b for a, b in pairwise(cu))


def test_more_sequences_than_slots_is_refused():
    with pytest.raises(ValueError, match="do not fit"):
        _cu_seqlens([1] * 10, 16, 16, 4)


def test_graph_mode_is_the_one_causal_flag_of_an_unmasked_call():
    assert graph_mode(None, False) is False and graph_mode(None, [False, False]) is False
    assert graph_mode(None, True) is True and graph_mode(None, [True, True]) is True
    assert graph_mode(None, [False, True]) is None  # mixed flags: eager
    assert graph_mode(torch.zeros(3, dtype=torch.bool), False) is None  # a mask: eager
    assert graph_mode(None, torch.tensor([False])) is False
    assert graph_mode(None, torch.tensor([True, True])) is True
    assert graph_mode(None, torch.tensor(True)) is True and graph_mode(None, []) is False


def _model(**kwargs) -> torch.nn.Module:
    module = torch.nn.MultiheadAttention(32, 4, batch_first=True, **kwargs).eval()
    return model_from_state_dict(module_config(module), module_state(module), "cpu", "float32")


def test_graphs_need_a_cuda_device():
    with pytest.raises(ValueError, match="CUDA device"):
        _model().enable_cuda_graphs()
    with pytest.raises(ValueError, match="CUDA device"):
        CudaGraphs(lambda x, plan: x, 32, torch.float32, torch.device("cpu"))


def test_layers_that_cannot_replay_are_refused(monkeypatch):
    model = _model(add_bias_kv=True)
    monkeypatch.setattr(type(model), "device", property(lambda self: torch.device("cuda")))
    with pytest.raises(ValueError, match="varlen kernel"):
        model.enable_cuda_graphs()


def test_an_eager_model_does_not_replay():
    model = _model()
    x = torch.randn(5, 32)
    assert model._replay(x, [5], False) is None
    assert model.cuda_graphs is None


def test_models_without_a_packed_self_attention_forward_are_refused(monkeypatch):
    layer = torch.nn.TransformerDecoderLayer(32, 4, 64, batch_first=True).eval()
    model = model_from_state_dict(module_config(layer), module_state(layer), "cpu", "float32")
    monkeypatch.setattr(type(model), "device", property(lambda self: torch.device("cuda")))
    with pytest.raises(ValueError, match="no packed self-attention forward"):
        model.enable_cuda_graphs()


class _Recording:
    """Stands in for a captured CUDA graph: replay re-runs the captured call, which reads the
    static buffers as they are now (what a graph's kernels do)."""

    def __init__(self, fn) -> None:
        self.fn, self.out = fn, fn()

    def replay(self) -> None:
        with torch.inference_mode():  # the captured output is an inference tensor
            self.out.copy_(self.fn())


class _Event:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def record(self) -> None:
        self.log.append(f"record {id(self)}")

    def synchronize(self) -> None:
        self.log.append(f"wait {id(self)}")


@pytest.fixture
def stand_in(monkeypatch):
    """CudaGraphs on the CPU: captures recorded, pinned buffers plain, events logged."""
    log: list[str] = []

    def record(fn, device, pool):
        graph = _Recording(fn)
        return graph, graph.out

    monkeypatch.setattr(cuda_graphs, "_record", record)
    monkeypatch.setattr(cuda_graphs, "_pinned", lambda like: torch.empty_like(like))
    monkeypatch.setattr(cuda_graphs, "_event", lambda: _Event(log))
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, 0))
    return log


def _graphs(model, max_tokens=256, max_sequences=8, max_graphs=64) -> CudaGraphs:
    """CudaGraphs of the model's eager forward_packed as the captured call: it splits the static
    rows at the static cu_seqlens as they are at replay, with the bucket's causal flag."""

    def run(x, plan):
        cu = plan.cu_seqlens.tolist()  # read at every replay, as the graph's kernels do
        return model.forward_packed(x, cu, is_causal=plan.causal)

    graphs = CudaGraphs(run, model.embed_dim, model.dtype, torch.device("cuda"), max_tokens,
                        max_sequences, max_graphs)  # fmt: skip
    graphs.device = torch.device("cpu")  # the stood-in capture runs on the CPU
    return graphs


@pytest.mark.parametrize("causal", [False, True])
def test_replay_gives_each_sequence_its_eager_numbers(stand_in, causal):
    """Every batch through the replay protocol equals the eager forward of its sequences:
    the rows copied in, the padding zeroed, the layout uploaded, the output cut to N rows."""
    torch.manual_seed(0)
    model = _model()
    graphs = _graphs(model)
    for lens in ([5, 9], [3, 7, 1], [5, 9], [16], [1] * 8, [40, 2, 70]):
        cu = cumulative(lens)
        x = torch.randn(cu[-1], 32)
        got = graphs(x, lens, causal)
        assert got is not None and got.shape == x.shape
        torch.testing.assert_close(got, model.forward_packed(x, cu, is_causal=causal),
                                   atol=1e-6, rtol=0)  # fmt: skip
        for i, n in enumerate(lens):  # each sequence as if alone
            alone = model.forward_packed(x[cu[i] : cu[i + 1]], [0, n], is_causal=causal)
            torch.testing.assert_close(got[cu[i] : cu[i + 1]], alone, atol=1e-6, rtol=0)
    assert {key[2] for key in graphs.graphs} == {causal}  # one graph per bucket and flag


def test_causal_and_non_causal_calls_replay_different_graphs(stand_in):
    torch.manual_seed(0)
    model = _model()
    graphs = _graphs(model)
    x = torch.randn(12, 32)
    plain, causal = graphs(x, [12], False), graphs(x, [12], True)
    assert set(graphs.graphs) == {(16, 16, False), (16, 16, True)}
    assert not torch.allclose(plain, causal)  # the causal graph masks later keys
    torch.testing.assert_close(causal, model.forward_packed(x, [0, 12], is_causal=True),
                               atol=1e-6, rtol=0)  # fmt: skip


def test_layouts_upload_through_two_host_buffers_in_turn(stand_in):
    """A new layout waits only for its buffer's previous upload (two layouts back), and an
    unchanged layout uploads nothing."""
    torch.manual_seed(0)
    graphs = _graphs(_model())
    x = torch.randn(10, 32)
    graphs(x, [4, 6])
    (graph,) = graphs.graphs.values()
    first, second = (id(e) for e in graph.uploads)
    assert stand_in == [f"wait {second}", f"record {second}"]
    graphs(x, [4, 6])  # same layout: no upload
    assert len(stand_in) == 2
    graphs(x, [5, 5])
    graphs(x, [1, 9])
    turns = [f"wait {first}", f"record {first}", f"wait {second}", f"record {second}"]
    assert stand_in[2:] == turns
    assert graph.cu.tolist()[:3] == [0, 1, 10]  # the static buffer holds the last layout


def test_warm_captures_every_bucket_within_the_bounds(stand_in):
    graphs = _graphs(_model(), max_tokens=64, max_graphs=64)
    assert graphs.warm() == 1 + 2 + 3  # tokens 16, 32, 64: lengths 16 .. tokens
    assert graphs.warm(causal=True) == 12 and all(len(k) == 3 for k in graphs.graphs)
    capped = _graphs(_model(), max_tokens=64, max_graphs=4)
    assert capped.warm() == 4
    assert capped(torch.randn(60, 32), [60]) is None  # no room for its bucket: eager


def test_the_model_replays_unmasked_self_attention_causal_or_not(stand_in):
    """forward_packed replays when every sequence is causal or none is; mixed flags, masks and
    cross-attention run eagerly, all with the eager numbers."""
    torch.manual_seed(0)
    eager = _model()
    graphed = _model()
    graphed.load_state_dict(eager.state_dict())
    graphed.cuda_graphs = graphs = _graphs(eager)
    x = torch.randn(20, 32)
    cu = [0, 8, 20]
    calls = [
        ({"is_causal": [True, True]}, 1),
        ({"is_causal": True}, 1),
        ({"is_causal": False}, 1),
        ({"is_causal": [True, False]}, 0),
        ({"key_padding_mask": torch.zeros(20, dtype=torch.bool)}, 0),
        ({"key": x.clone(), "value": x.clone()}, 0),  # cross-attention (other tensors)
    ]
    for kwargs, replayed in calls:
        before = graphs.replays
        got = graphed.forward_packed(x, cu, **kwargs)
        assert graphs.replays == before + replayed, kwargs
        torch.testing.assert_close(got, eager.forward_packed(x, cu, **kwargs), atol=1e-6, rtol=0)


def test_record_warms_up_on_a_side_stream_then_captures_once(monkeypatch):
    """_record's CUDA calls, stood in for: two warm-up calls on a side stream that waits for the
    current one, the current stream waiting for them, then one call inside the capture."""
    log: list[str] = []

    class Stream:
        def __init__(self, name: str) -> None:
            self.name = name

        def wait_stream(self, other: Stream) -> None:
            log.append(f"{self.name} waits for {other.name}")

    current = Stream("current")

    @contextlib.contextmanager
    def on(stream: Stream):
        log.append(f"on {stream.name}")
        yield
        log.append(f"off {stream.name}")

    @contextlib.contextmanager
    def capturing(graph, pool, capture_error_mode):
        log.append(f"capture into pool {pool}, {capture_error_mode}")
        yield
        log.append("captured")

    monkeypatch.setattr(torch.cuda, "Stream", lambda device: Stream("side"))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: "graph")
    monkeypatch.setattr(torch.cuda, "graph", capturing)
    calls = iter(range(10))

    def fn() -> torch.Tensor:
        log.append("call")
        return torch.full((1,), float(next(calls)))

    graph, out = cuda_graphs._record(fn, torch.device("cuda"), (7, 1))
    assert graph == "graph" and out.item() == 2.0  # the captured call's output
    assert log == [
        "side waits for current", "on side", "call", "call", "off side",
        "current waits for side", "capture into pool (7, 1), thread_local", "call", "captured",
    ]  # fmt: skip


def test_a_failed_capture_runs_eagerly_and_is_not_tried_again(stand_in, monkeypatch, caplog):
    """A capture the driver refuses (another thread's CUDA call, out of memory) must not fail
    the batch: that bucket runs eagerly from then on, the others still replay."""
    attempts: list[int] = []
    record = cuda_graphs._record

    def refuse_32(fn, device, pool):
        out = fn()
        attempts.append(out.shape[0])
        if out.shape[0] == 32:
            raise RuntimeError("operation not permitted when stream is capturing")
        return record(fn, device, pool)

    monkeypatch.setattr(cuda_graphs, "_record", refuse_32)
    graphs = _graphs(_model(), max_tokens=64)
    assert graphs.warm() == 6 - 2  # the two 32-token buckets failed, the rest were captured
    assert "failed; it runs eagerly" in caplog.text
    x = torch.randn(20, 32)
    assert graphs(x, [20]) is None  # its bucket (32, 32) failed at warm-up: eager
    assert graphs(x[:10], [10]) is not None
    assert attempts.count(32) == 2  # never tried again
