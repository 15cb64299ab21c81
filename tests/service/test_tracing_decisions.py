"""Tracing's decisions and its exporter without a server: traceparent and tracestate parsing,
sampling by rate, count, caller and model, the settings' validation at start, and the export
thread (a bad trace does not stop it; a collector that is down does not hold the stop)."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from service.runtime.trace_export import OtlpSink
from service.runtime.tracing import Trace, TraceControl, parse_traceparent, queue_and_compute
from tests.otlp import Collector
from tests.support import free_port, wait_for

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"
SAMPLED = f"00-{TRACE_ID}-{PARENT}-01"


class Kept:
    """A sink keeping what it is given (the decisions below need no exporter)."""

    def __init__(self) -> None:
        self.traces: list = []

    def write(self, trace) -> None:
        self.traces.append(trace)

    def shutdown(self, timeout: float) -> None:
        pass


@pytest.mark.parametrize(
    ("header", "expected"),
    [
        (SAMPLED, (int(TRACE_ID, 16), int(PARENT, 16), True)),
        (f"00-{TRACE_ID}-{PARENT}-00", (int(TRACE_ID, 16), int(PARENT, 16), False)),
        (f"00-{TRACE_ID}-{PARENT}-03", (int(TRACE_ID, 16), int(PARENT, 16), True)),
        (f"00-{'0' * 32}-{PARENT}-01", None),  # all-zero trace id: invalid
        (f"00-{TRACE_ID}-{'0' * 16}-01", None),
        (f"01-{TRACE_ID}-{PARENT}-01-more", (int(TRACE_ID, 16), int(PARENT, 16), True)),  # later
        (f"ff-{TRACE_ID}-{PARENT}-01", None),  # version ff: invalid
        (f"00-{TRACE_ID}-{PARENT}-01-more", None),  # version 00 has exactly four fields
        (f"00-{TRACE_ID.upper()}-{PARENT}-01", None),  # W3C: lower-case hex only
        ("", None),
        (None, None),
    ],
)
def test_traceparent_parsing(header, expected):
    parent = parse_traceparent(header)
    got = None if parent is None else (parent.trace_id, parent.span_id, parent.sampled)
    assert got == expected


def test_rate_count_and_parent_decide_alone():
    sink = Kept()
    control = TraceControl("TIMESTAMPS", 4, 3, sink, updatable=True)
    picked = [control.begin("m", "infer", None) is not None for _ in range(8)]
    assert picked == [False, False, False, True] * 2
    assert control.begin("m", "infer", SAMPLED) is not None  # the caller sampled it
    assert control.begin("m", "infer", f"00-{TRACE_ID}-{PARENT}-00") is None
    assert control.snapshot()["trace_count"] == "0"  # 3 taken
    assert control.begin("m", "infer", SAMPLED) is None
    off = TraceControl("OFF", 1, -1, sink, updatable=True)
    assert not off.active and off.begin("m", "infer", SAMPLED) is None
    off.update({"trace_level": "TIMESTAMPS"}, "m")  # one model on: the control is active
    assert off.active and off.begin("m", "infer", SAMPLED) is not None
    assert off.begin("other", "infer", SAMPLED) is None


def test_a_model_that_overrides_only_its_level_shares_the_global_counter():
    control = TraceControl("TIMESTAMPS", 2, -1, Kept(), updatable=True)
    control.update({"trace_level": ["TIMESTAMPS"]}, "a")
    picked = [control.begin(m, "infer", None) is not None for m in ("a", "b", "a", "b")]
    assert picked == [False, True, False, True]  # one counter for a and b: every 2nd request
    control.update({"trace_rate": "3"}, "a")  # now a counts on its own
    picked = [control.begin("a", "infer", None) is not None for _ in range(3)]
    assert picked == [False, False, True]
    assert control.snapshot("b")["trace_rate"] == "2"


def test_without_an_endpoint_tracing_cannot_be_turned_on_and_workers_refuse_changes():
    control = TraceControl("OFF", 1000, -1, None, updatable=True)
    with pytest.raises(Exception, match="--otlp-endpoint"):
        control.update({"trace_level": ["TIMESTAMPS"]})
    assert control.update({"trace_rate": 10})["trace_rate"] == "10"
    fixed = TraceControl("OFF", 1000, -1, None, updatable=False)
    with pytest.raises(Exception, match="--workers > 1"):
        fixed.update({"trace_rate": "5"})
    assert fixed.update({}) == fixed.snapshot()  # a read is always allowed


def test_start_up_refuses_a_level_without_an_endpoint_and_a_bad_url(tmp_path: Path):
    from service.runtime.settings import Settings

    with pytest.raises(ValueError, match="needs --otlp-endpoint"):
        Settings(trace_level="TIMESTAMPS")
    with pytest.raises(ValueError, match="must be an http"):
        Settings(otlp_endpoint="collector:4318")
    assert Settings(otlp_endpoint="http://c:4318").trace_level is None


def test_a_collector_that_is_down_does_not_hold_the_stop():
    """Export retries to a closed port go on for the exporter's timeout (10 s); the server's
    stop waits for them at most the sink's shutdown timeout."""
    sink = OtlpSink(f"http://127.0.0.1:{free_port()}")
    for _ in range(3):
        trace = Trace(sink, None, "infer m", time.perf_counter())
        trace.step("queue", trace.start, trace.start + 0.001)
        trace.end()
    sink.wake.set()  # export now: the thread is in its retries when the stop comes
    wait_for(lambda: not sink.queue, "the export thread taking the traces", timeout=10)
    time.sleep(0.1)  # into the exporter's first retry
    assert sink.thread.is_alive()
    started = time.monotonic()
    sink.shutdown(timeout=1.0)
    assert time.monotonic() - started < 3.0


@pytest.mark.parametrize(
    ("tracestate", "kept"),
    [
        ("vendor=abc", "vendor=abc"),
        ("rojo=00f067aa0ba902b7, congo=t61rcWkgMzE", "rojo=00f067aa0ba902b7, congo=t61rcWkgMzE"),
        ("not a list", None),
        ("a=" + "x" * 600, None),  # over 512 characters
        (",".join(f"k{i}=v" for i in range(33)), None),  # over 32 members
    ],
)
def test_a_malformed_tracestate_is_dropped_not_passed_on(tracestate, kept):
    parent = parse_traceparent(SAMPLED, tracestate)
    assert parent is not None and parent.tracestate == kept


def test_without_following_callers_a_traceparent_is_only_the_parent():
    control = TraceControl("TIMESTAMPS", 3, -1, Kept(), updatable=True, follow_callers=False)
    traces = [control.begin("m", "infer", SAMPLED) for _ in range(6)]
    picked = [t is not None for t in traces]
    assert picked == [False, False, True] * 2  # the rate decides, not the caller's flag
    assert traces[2].parent.trace_id == int(TRACE_ID, 16)
    unsampled = f"00-{TRACE_ID}-{PARENT}-00"
    assert [control.begin("m", "infer", unsampled) is not None for _ in range(3)][-1]


def test_a_work_that_never_computed_has_no_compute_step():
    trace = Trace(Kept(), None, "infer m", 1.0)
    queue_and_compute(trace, SimpleNamespace(started_at=None))  # never started
    withdrawn = SimpleNamespace(enqueued_at=1.0, started_at=1.5, infer_s=0.0, batch_sequences=0)
    queue_and_compute(trace, withdrawn)
    done = SimpleNamespace(enqueued_at=2.0, started_at=2.5, infer_s=0.25, batch_sequences=3)
    queue_and_compute(trace, done)
    steps = [(name, start, end, values) for name, start, end, values in trace.steps]
    assert steps == [
        ("queue", 1.0, 1.5, {}),
        ("queue", 2.0, 2.5, {}),
        ("compute", 2.5, 2.75, {"mha.batch.sequences": 3}),
    ]


def test_a_trace_that_cannot_be_built_does_not_stop_the_export_thread(monkeypatch):
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "20")
    collector = Collector()
    sink = OtlpSink(collector.url)
    try:
        bad = Trace(sink, None, "infer bad", time.perf_counter())
        bad.steps.append(("decode", bad.start, None, {}))  # no end: building it raises
        bad.end()
        wait_for(lambda: not sink.queue, "the export thread taking the bad trace", timeout=10)
        good = Trace(sink, None, "infer good", time.perf_counter())
        good.end()
        assert list(collector.trace("infer good", 1))
        assert sink.thread.is_alive()
    finally:
        sink.shutdown(timeout=2.0)
        collector.stop()


def test_a_missing_sdk_is_one_start_up_line_saying_how_to_install_it(monkeypatch):
    import importlib

    from service.__main__ import check_tracing
    from service.runtime.settings import Settings
    from service.runtime.startup import EXIT_CONFIG, StartupError

    real = importlib.import_module

    def without_exporters(name: str, *args):
        if name.startswith("opentelemetry.exporter"):
            raise ImportError(f"No module named '{name}'")
        return real(name, *args)

    monkeypatch.setattr(importlib, "import_module", without_exporters)
    for protocol in ("http/protobuf", "grpc"):
        settings = Settings(otlp_endpoint="http://c:4318", otlp_protocol=protocol)
        with pytest.raises(StartupError) as caught:
            check_tracing(settings)
        assert caught.value.status == EXIT_CONFIG
        assert "pip install 'mha-serve[tracing]'" in str(caught.value)
    check_tracing(Settings())  # no endpoint: nothing to check
