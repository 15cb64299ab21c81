"""CUDA graphs on the CPU: the bucket a batch gets, the padded cu_seqlens it replays with, the
refusals (no CUDA device, layers that cannot replay), and CudaGraphs' replay protocol (static
buffers, the double-buffered cu_seqlens upload, causal buckets) with the capture stood in for by
a recording that re-runs the captured call on the static buffers. The real replays run on a GPU
in tests/gpu/test_gpu_engine.py."""

from __future__ import annotations

import contextlib

import pytest
import torch

import mha_engine.cuda_graphs as cuda_graphs
from mha_engine.checkpoint import model_from_state_dict
from mha_engine.cuda_graphs import CudaGraphs, graph_mode
from mha_engine.save import module_config, module_state
from mha_engine.varlen import cumulative


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


def test_decoders_capture_cross_attention_graphs_only(stand_in, monkeypatch):
    """A decoder has no self-attention-only forward (nothing warmed at load) but replays its
    whole stack, cross-attention included, from graphs captured on first use."""
    layer = torch.nn.TransformerDecoderLayer(32, 4, 64, batch_first=True).eval()
    model = model_from_state_dict(module_config(layer), module_state(layer), "cpu", "float32")
    monkeypatch.setattr(type(model), "device", property(lambda self: torch.device("cuda")))
    graphs = model.enable_cuda_graphs(max_tokens=256)
    assert graphs.count == 0 and graphs.run is None and graphs.cross_run is not None
    assert graphs.memory_widths == (32,)


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

    def record(self, stream=None) -> None:
        self.log.append(f"record {id(self)}")

    def synchronize(self) -> None:
        self.log.append(f"wait {id(self)}")


@pytest.fixture
def stand_in(monkeypatch):
    """CudaGraphs on the CPU: captures recorded, pinned buffers plain, events logged."""
    log: list[str] = []

    def record(fn, device, pool, stream):
        graph = _Recording(fn)
        return graph, graph.out

    monkeypatch.setattr(cuda_graphs, "_record", record)
    monkeypatch.setattr(cuda_graphs, "_new_stream", lambda device: None)
    monkeypatch.setattr(cuda_graphs, "_current_stream", lambda device: None)
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
    assert graph.cus[0].tolist()[:3] == [0, 1, 10]  # the static buffer holds the last layout


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


@pytest.fixture
def fake_cuda(monkeypatch):
    """torch.cuda's stream, device and capture calls as a log: (log, the current stream)."""
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
    def capturing(graph, pool, stream, capture_error_mode):
        log.append(f"capture on {stream.name} into pool {pool}, {capture_error_mode}")
        yield  # torch's context: on an error, capture_end raises and the stream stays current
        log.append("captured")

    @contextlib.contextmanager
    def device(index):
        log.append(f"on device {index}")
        try:
            yield
        finally:  # torch.cuda.device puts the previous device back on any exit
            log.append(f"off device {index}")

    monkeypatch.setattr(torch.cuda, "Stream", lambda device: Stream("side"))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.cuda, "set_stream", lambda s: log.append(f"set {s.name}"))
    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: "graph")
    monkeypatch.setattr(torch.cuda, "graph", capturing)
    return log, Stream


def test_record_warms_up_on_a_side_stream_then_captures_once(fake_cuda):
    """_record's CUDA calls, stood in for: on the model's device (a new thread's current device
    is cuda:0), two warm-up calls on a side stream that waits for the current one, the current
    stream waiting for them, then one call inside the capture, on the pool's capture stream."""
    log, Stream = fake_cuda
    calls = iter(range(10))

    def fn() -> torch.Tensor:
        log.append("call")
        return torch.full((1,), float(next(calls)))

    graph, out = cuda_graphs._record(fn, torch.device("cuda:1"), (7, 1), Stream("capture"))
    assert graph == "graph" and out.item() == 2.0  # the captured call's output
    assert log == [
        "on device cuda:1", "side waits for current", "on side", "call", "call", "off side",
        "current waits for side", "capture on capture into pool (7, 1), thread_local", "call",
        "captured", "off device cuda:1",
    ]  # fmt: skip
    assert not cuda_graphs._CAPTURE_LOCK.locked()


def test_a_capture_that_raises_puts_the_threads_stream_back(fake_cuda):
    log, Stream = fake_cuda
    state = {"calls": 0}

    def fn() -> torch.Tensor:
        state["calls"] += 1
        if state["calls"] == 3:  # the captured call
            raise RuntimeError("operation not permitted when stream is capturing")
        return torch.zeros(1)

    with pytest.raises(RuntimeError, match="not permitted"):
        cuda_graphs._record(fn, torch.device("cuda"), (7, 1), Stream("capture"))
    assert log[-3:] == ["capture on capture into pool (7, 1), thread_local", "set current",
                        "off device cuda"]  # fmt: skip
    assert not cuda_graphs._CAPTURE_LOCK.locked()


def test_one_capture_at_a_time(fake_cuda):
    """Two models capturing on their own threads (a load's warm-up while another model serves)
    never capture at once: PyTorch allows one capture per process."""
    import threading
    import time

    log, Stream = fake_cuda
    inside, most = [0], [0]

    def fn() -> torch.Tensor:
        inside[0] += 1
        most[0] = max(most[0], inside[0])
        time.sleep(0.02)
        inside[0] -= 1
        return torch.zeros(1)

    def capture() -> None:
        cuda_graphs._record(fn, torch.device("cuda"), (7, 1), Stream("capture"))

    threads = [threading.Thread(target=capture) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert most[0] == 1 and log.count("captured") == 3


def test_a_failed_capture_runs_eagerly_and_stops_further_captures(stand_in, monkeypatch, caplog):
    """A capture the driver refuses (out of memory, an uncapturable call) must not fail the
    batch: that bucket, and every one not yet captured, runs eagerly from then on (what a failed
    capture leaves behind is not worth another try while serving); the graphs held replay."""
    attempts: list[int] = []
    record = cuda_graphs._record

    def refuse_32(fn, device, pool, stream):
        out = fn()
        attempts.append(out.shape[0])
        if out.shape[0] == 32:
            raise RuntimeError("operation not permitted when stream is capturing")
        return record(fn, device, pool, stream)

    monkeypatch.setattr(cuda_graphs, "_record", refuse_32)
    graphs = _graphs(_model(), max_tokens=64)
    assert graphs.warm() == 1  # (16, 16); the first 32-token bucket failed; none after it
    assert graphs.stopped and "every bucket not yet captured run eagerly" in caplog.text
    x = torch.randn(20, 32)
    assert graphs(x, [20]) is None  # bucket (32, 32): never captured, eager
    assert graphs(x[:10], [10]) is not None  # (16, 16) still replays
    assert graphs(x[:10], [10], causal=True) is None  # a first-use bucket: no capture now
    assert attempts == [16, 32]  # nothing tried after the failure


def _decoder(d_model: int = 32) -> torch.nn.Module:
    torch.manual_seed(0)
    layer = torch.nn.TransformerDecoderLayer(d_model, 4, 64, batch_first=True).eval()
    decoder = torch.nn.TransformerDecoder(layer, 2).eval()
    return model_from_state_dict(module_config(decoder), module_state(decoder), "cpu", "float32")


def _cross_graphs(model, max_tokens=256, max_sequences=8) -> CudaGraphs:
    """CudaGraphs whose captured cross-attention call is the model's eager forward_packed on the
    static buffers, split at the static layouts as they are at replay."""

    def cross_run(x, memory, self_plan, cross_plan):
        cu_q, cu_k = cross_plan.cu_seqlens.tolist(), cross_plan.cu_seqlens_k.tolist()
        if len(memory) == 2:  # an attention block: its own key and value
            return model.forward_packed(x, cu_q, memory[0], memory[1], cu_k)
        return model.forward_packed(x, cu_q, memory[0], cu_k, tgt_is_causal=self_plan.causal)

    widths = (model.kdim, model.vdim) if model.architecture == "multihead_attention" else (32,)
    graphs = CudaGraphs(None, model.embed_dim, model.dtype, torch.device("cuda"), max_tokens,
                        max_sequences, 64, cross_run, widths)  # fmt: skip
    graphs.device = torch.device("cpu")
    return graphs


BATCHES = [([5, 9], [7, 3]), ([3, 7, 1], [1, 20, 4]), ([5, 9], [7, 3]), ([40, 2], [2, 90])]


def test_cross_replay_gives_each_sequence_its_eager_numbers(stand_in):
    """Queries against memories of their own, through the replay protocol: the eager numbers
    of every pair, alone or batched; the layouts upload both cu_seqlens in one copy."""
    torch.manual_seed(0)
    model = _model()
    graphs = _cross_graphs(model)
    for q_lens, k_lens in BATCHES:
        cu_q, cu_k = cumulative(q_lens), cumulative(k_lens)
        x, key, value = (
            torch.randn(cu_q[-1], 32),
            torch.randn(cu_k[-1], 32),
            torch.randn(cu_k[-1], 32),
        )
        got = graphs.cross(x, q_lens, (key, value), k_lens)
        assert got is not None and got.shape == x.shape
        want = model.forward_packed(x, cu_q, key, value, cu_k)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
        for i in range(len(q_lens)):
            q, k = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
            alone = model.forward_packed(x[q], [0, q_lens[i]], key[k], value[k], [0, k_lens[i]])
            torch.testing.assert_close(got[q], alone, atol=1e-6, rtol=0)
    assert all(len(key) == 5 for key in graphs.graphs)
    assert graphs(torch.randn(4, 32), [4]) is None  # no self-attention run: never replays


@pytest.mark.parametrize("causal", [False, True])
def test_a_decoder_stack_replays_with_its_causal_self_attention(stand_in, causal):
    torch.manual_seed(0)
    model = _decoder()
    graphs = _cross_graphs(model)
    for q_lens, k_lens in BATCHES:
        cu_q, cu_k = cumulative(q_lens), cumulative(k_lens)
        x, memory = torch.randn(cu_q[-1], 32), torch.randn(cu_k[-1], 32)
        got = graphs.cross(x, q_lens, (memory,), k_lens, causal)
        want = model.forward_packed(x, cu_q, memory, cu_k, tgt_is_causal=causal)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    assert {key[4] for key in graphs.graphs} == {causal}


def test_models_replay_unmasked_cross_attention_and_run_the_rest_eagerly(stand_in):
    """forward_packed of an attention block with its own key and value, and of a decoder,
    replays; masks, mixed causal flags and a key that is also the value run eagerly, all with
    the eager numbers."""
    torch.manual_seed(0)
    eager, graphed = _model(), _model()
    graphed.load_state_dict(eager.state_dict())
    graphed.cuda_graphs = graphs = _cross_graphs(eager)
    x, key, value = torch.randn(14, 32), torch.randn(10, 32), torch.randn(10, 32)
    cu_q, cu_k = [0, 5, 14], [0, 7, 10]
    mask = torch.zeros(10, dtype=torch.bool)
    calls = [
        ({"value": value}, 1),
        ({"value": value, "key_padding_mask": mask}, 0),
        ({"value": value, "is_causal": True}, 0),
        ({}, 0),  # the key is the value: one fused K/V GEMM eagerly, so no graph
    ]
    for kwargs, replayed in calls:
        before = graphs.replays
        got = graphed.forward_packed(x, cu_q, key, cu_seqlens_k=cu_k, **kwargs)
        assert graphs.replays == before + replayed, kwargs
        want = eager.forward_packed(x, cu_q, key, cu_seqlens_k=cu_k, **kwargs)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)

    eager, graphed = _decoder(), _decoder()
    graphed.cuda_graphs = graphs = _cross_graphs(eager)
    memory = torch.randn(10, 32)
    calls = [
        ({"tgt_is_causal": True}, 1),
        ({"tgt_is_causal": [True, False]}, 0),
        ({"memory_key_padding_mask": mask}, 0),
        ({"tgt_key_padding_mask": torch.zeros(14, dtype=torch.bool)}, 0),
        ({}, 1),
    ]
    for kwargs, replayed in calls:
        before = graphs.replays
        got = graphed.forward_packed(x, cu_q, memory, cu_k, **kwargs)
        assert graphs.replays == before + replayed, kwargs
        torch.testing.assert_close(got, eager.forward_packed(x, cu_q, memory, cu_k, **kwargs),
                                   atol=1e-6, rtol=0)  # fmt: skip
