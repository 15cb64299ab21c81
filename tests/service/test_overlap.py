"""--cuda-overlap: batches launched on the engine thread and finished on a completer thread, their
copies on their own CUDA streams. On CPU hosts the batcher's pipeline runs for real with the
engine on CPU, and the CUDA branch runs with torch.cuda stood in for (streams, events, pinned
memory); the GPU tests run it on a device with MHA_TEST_CUDA_OVERLAP=1."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

import numpy as np
import pytest
import torch

import mha_engine
from service.pipeline.errors import BadInput, InferenceError
from service.runtime import forward
from service.runtime.batcher import DynamicBatcher
from service.runtime.completer import Completer
from service.runtime.device_copies import DeviceCopies
from tests.service.test_batcher import make_work

FP32 = {"atol": 1e-5, "rtol": 1.3e-6}


def _batcher(model, **kwargs) -> DynamicBatcher:
    limits = {"max_batch_size": 4, "max_batch_tokens": 4096, "max_batch_delay_s": 0.0}
    return DynamicBatcher(model, max_queue=256, overlap=True, **{**limits, **kwargs})


def _serve(batcher: DynamicBatcher, inputs: list[np.ndarray], runner=None) -> list[object]:
    """Submit every input at once, await all (errors as values), stop the batcher."""

    async def run() -> list[object]:
        loop = asyncio.get_running_loop()
        works = [make_work(x, loop) for x in inputs]
        for work in works:
            if runner is not None:
                work.runner = runner
            batcher.submit(work)
        return await asyncio.gather(*(w.future for w in works), return_exceptions=True)

    batcher.start()
    try:
        return asyncio.run(run())
    finally:
        batcher.stop(timeout=30)


def _check(results: list[object], inputs: list[np.ndarray]) -> None:
    reference = mha_engine.demo_module().eval()
    for x, got in zip(inputs, results, strict=True):
        want = reference(torch.from_numpy(x)).detach()[0]
        torch.testing.assert_close(torch.from_numpy(got), want, **FP32)  # (T, E)


def _inputs(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((1, 3 + i % 5, 512)).astype(np.float32) for i in range(n)]


def test_every_batch_is_answered_with_pytorchs_numbers_and_a_culprit_fails_alone(caplog):
    """Many small batches through the pipeline (launch, then finish on the completer): each
    request gets nn.MultiheadAttention's numbers; a request that makes the forward raise at
    launch fails alone, its batch-mates retried; the engine_busy count returns to zero."""
    model = mha_engine.build_demo_model(device="cpu")
    inputs = _inputs(30)
    bad = np.random.default_rng(1).standard_normal((1, 5, 7)).astype(np.float32)  # width 7

    class Observer:
        running = 0

        def queue_depth(self, sequences):
            pass

        def expired(self, work):
            pass

        def batch_started(self, works):
            self.running += 1

        def batch_done(self, works, compute_s, ok):
            self.running -= 1

    observer = Observer()
    results = _serve(_batcher(model, observer=observer), [*inputs[:10], bad, *inputs[10:]])
    assert isinstance(results[10], InferenceError)
    assert "forward failed for a batch of" in caplog.text
    _check(results[:10] + results[11:], inputs)
    assert observer.running == 0  # every batch started was reported done


def test_a_batch_that_fails_while_finishing_fails_its_requests_and_the_next_batch_runs(caplog):
    """An error at the wait (the device's: a bad input fails at launch) answers each request of
    that batch with an error; the batcher keeps serving."""
    model = mha_engine.build_demo_model(device="cpu")

    def broken(model, payloads):
        raise AssertionError("only its launcher runs")

    def launch_broken(model, payloads, copies):
        def finish():
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        return finish

    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(forward.LAUNCHERS, broken, launch_broken)
        results = _serve(_batcher(model), _inputs(3), runner=broken)
    assert all(isinstance(r, InferenceError) for r in results)
    assert "failed on the device" in caplog.text
    inputs = _inputs(3, seed=2)
    _check(_serve(_batcher(model), inputs), inputs)


def test_the_completer_holds_at_most_depth_batches_and_finishes_them_in_order():
    done: list[int] = []
    gate = threading.Event()

    def finish(n: int) -> None:
        gate.wait(10)
        done.append(n + 0)

    completer = Completer(finish, depth=2)
    for n in range(2):
        completer.reserve()
        completer.put(n)
    third = threading.Thread(target=completer.reserve)
    third.start()
    third.join(0.2)
    assert third.is_alive(), "a third batch was let in while two were in flight"
    gate.set()
    third.join(10)
    assert not third.is_alive()
    completer.put(2)
    completer.put("not a number")  # finish raises: logged, the thread goes on
    completer.put(3)
    completer.close()
    assert done == [0, 1, 2, 3]


def test_stop_answers_every_launched_batch():
    model = mha_engine.build_demo_model(device="cpu")
    batcher = _batcher(model)
    inputs = _inputs(12, seed=3)

    async def run() -> list[object]:
        loop = asyncio.get_running_loop()
        works = [make_work(x, loop) for x in inputs]
        for work in works:
            batcher.submit(work)
        await asyncio.to_thread(batcher.stop, 30)  # at once: the queued batches still run
        return await asyncio.wait_for(asyncio.gather(*(w.future for w in works)), 10)

    batcher.start()
    _check(asyncio.run(run()), inputs)


class FakeCuda:
    """torch.cuda as far as DeviceCopies and forward.stage use it, on CPU tensors: streams and
    events that record what was queued where, pinned memory as plain memory."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.log: list[tuple[str, str, str]] = []
        self.compute = self.Stream(self, "compute")
        self.current = self.compute
        fake = self
        real_to, real_empty = torch.Tensor.to, torch.empty

        def to(tensor, *args, **kwargs):
            device = kwargs.get("device")
            if device is not None and torch.device(device).type == "cuda":
                fake.log.append(("upload", fake.current.name, str(kwargs.get("non_blocking"))))
                kwargs["device"] = "cpu"
            return real_to(tensor, *args, **kwargs)

        def empty(*args, pin_memory=False, **kwargs):
            if pin_memory:
                fake.log.append(("pinned", fake.current.name, ""))
            return real_empty(*args, **kwargs)

        def record_stream(tensor, stream):
            fake.log.append(("record_stream", stream.name, ""))

        @contextlib.contextmanager
        def stream(s):
            before, fake.current = fake.current, s
            try:
                yield
            finally:
                fake.current = before

        names = iter(["up", "down"])
        monkeypatch.setattr(torch.Tensor, "to", to)
        monkeypatch.setattr(torch, "empty", empty)
        monkeypatch.setattr(torch.Tensor, "record_stream", record_stream)
        monkeypatch.setattr(torch.cuda, "Stream", lambda device: self.Stream(self, next(names)))
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: self.current)
        monkeypatch.setattr(torch.cuda, "stream", stream)
        monkeypatch.setattr(torch.cuda, "Event", lambda: self.Event(self))

    class Stream:
        def __init__(self, fake: FakeCuda, name: str) -> None:
            self.fake, self.name = fake, name

        def wait_stream(self, other: FakeCuda.Stream) -> None:
            self.fake.log.append(("wait", self.name, other.name))

    class Event:
        def __init__(self, fake: FakeCuda) -> None:
            self.fake = fake

        def record(self, stream: FakeCuda.Stream) -> None:
            self.fake.log.append(("event", stream.name, ""))

        def synchronize(self) -> None:
            self.fake.log.append(("synchronize", "host", ""))


def test_the_cuda_branch_queues_copies_on_their_streams(monkeypatch):
    """A CUDA model with --cuda-overlap (device patched, tensors on CPU): inputs go up on the
    upload stream from pinned memory without blocking and the compute stream waits for them;
    outputs come down into pinned memory on the download stream after the compute; the host
    waits on one event per batch. The numbers are PyTorch's."""
    fake = FakeCuda(monkeypatch)
    model = mha_engine.build_demo_model(device="cpu")
    cuda = property(lambda self: torch.device("cuda:0"))
    monkeypatch.setattr(type(model), "device", cuda)
    inputs = _inputs(4, seed=4)
    batcher = _batcher(model, max_batch_delay_s=1.0)  # the four in one batch
    results = _serve(batcher, inputs)
    _check(results, inputs)
    assert isinstance(batcher._runner._copies, DeviceCopies)
    assert fake.log == [
        ("pinned", "compute", ""),  # stage: the request arrays into pinned memory
        ("upload", "up", "True"),  # one non-blocking copy on the upload stream
        ("wait", "compute", "up"),
        ("record_stream", "compute", ""),  # the input, allocated on `up`, used on compute
        ("wait", "down", "compute"),  # the download after the forward
        ("pinned", "down", ""),
        ("record_stream", "down", ""),  # the output
        ("pinned", "down", ""),
        ("record_stream", "down", ""),  # its sum (the NaN/Inf check)
        ("event", "down", ""),
        ("synchronize", "host", ""),  # on the completer thread
    ]


def test_the_cuda_branch_answers_nan_inputs_400_and_their_batch_mates_in_full(monkeypatch):
    """With the CUDA branch's downloads, a batch whose output sum is not finite: the request
    with NaN inputs gets its 400, its batch-mates their numbers (the float64 recheck and the
    per-request checks run after the wait)."""
    FakeCuda(monkeypatch)
    model = mha_engine.build_demo_model(device="cpu")
    cuda = property(lambda self: torch.device("cuda:0"))
    monkeypatch.setattr(type(model), "device", cuda)
    inputs = _inputs(3, seed=5)
    poisoned = inputs[1].copy()
    poisoned[0, 0, 0] = np.nan
    results = _serve(_batcher(model, max_batch_delay_s=1.0), [inputs[0], poisoned, inputs[2]])
    assert isinstance(results[1], BadInput) and "NaN or Inf" in str(results[1])
    _check([results[0], results[2]], [inputs[0], inputs[2]])


def test_overlap_is_only_taken_for_cuda_models(monkeypatch):
    """--cuda-overlap on a CPU model: batches run and finish on the engine thread as always."""
    from service.runtime import loading
    from service.runtime.metrics import Metrics
    from service.runtime.repository import ModelSource
    from service.runtime.settings import Settings

    source = ModelSource("mha", None)
    entry = asyncio.run(
        loading.load_entry(Settings(cuda_overlap=True), Metrics("mha", "1"), source)
    )
    assert entry.batcher.overlap is False
    cuda = property(lambda self: torch.device("cuda:0"))
    monkeypatch.setattr(mha_engine.models.EngineModel, "device", cuda)
    monkeypatch.setattr(loading, "load_served_model", lambda settings, path: entry.model)
    monkeypatch.setattr(loading, "model_info", lambda model, name: {})  # reads CUDA's SDPA
    monkeypatch.setattr(Metrics, "set_cuda_engine", lambda self, model: None)
    monkeypatch.setattr(Metrics, "set_model_info", lambda self, info: None)
    on_cuda = asyncio.run(
        loading.load_entry(Settings(cuda_overlap=True), Metrics("mha", "1"), source)
    )
    assert on_cuda.batcher.overlap is True
    off = asyncio.run(loading.load_entry(Settings(), Metrics("mha", "1"), source))
    assert off.batcher.overlap is False


def test_a_batch_is_timed_from_launch_to_answer():
    """infer_s of a request covers its batch from launch until its outputs are on the host."""
    model = mha_engine.build_demo_model(device="cpu")
    slow = 0.05

    def launch_slow(model, payloads, copies):
        finish = forward.launch_hidden_states(model, payloads, copies)

        def wait():
            time.sleep(slow)
            return finish()

        return wait

    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(forward.LAUNCHERS, forward.hidden_states, launch_slow)
        batcher = _batcher(model)

        async def run() -> float:
            work = make_work(_inputs(1)[0], asyncio.get_running_loop())
            batcher.submit(work)
            await work.future
            return work.infer_s

        batcher.start()
        try:
            assert asyncio.run(run()) >= slow
        finally:
            batcher.stop(timeout=10)
