"""Request tracing: Triton's trace settings (global, and per model) decide which inference
requests are traced; a traced request's spans go to an OpenTelemetry collector over OTLP
(service.runtime.trace_export).

A traced request is one span (SERVER, child of the caller's W3C `traceparent` when it sends
one) with a child per step: decode, queue, compute (its batch's forward), encode for the OIP
core; tokenize, then queue and compute per batch part for the text routes. The spans are built
after the request ends, from the times the request core already takes for Triton's statistics
(the batch runner also notes each batch's size), and exported from a thread of their own
(service.runtime.trace_export). With tracing off a request costs one attribute check (and the
fronts' reset of TRACED).

Sampling: a request whose `traceparent` says "sampled" is traced, one that says "not sampled"
is not (the caller decided for the whole trace; --no-trace-callers leaves it to the rate);
without one, every `trace_rate`-th request is.
`trace_count` traces are taken, then no more (-1: no limit). Triton's `trace_file`,
`log_frequency` and `trace_mode` are shown with their only values here ("", "0",
"opentelemetry").
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
import time
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol

from service.pipeline.errors import BadInput, ServiceError

log = logging.getLogger("service.tracing")

LEVELS = ("OFF", "TIMESTAMPS")
FIXED = {"trace_file": "", "log_frequency": "0", "trace_mode": "opentelemetry"}
SETTINGS = ("trace_level", "trace_rate", "trace_count", *FIXED)
# The traced request this task serves, for the steps of the text routes (service.text.work)
CURRENT: ContextVar[Trace | None] = ContextVar("mha_trace", default=None)
# The trace begun for the request this task answers (set by begin(), cleared by the fronts at
# each request's start): its id goes on the request's metrics exemplar and access-log line
TRACED: ContextVar[Trace | None] = ContextVar("mha_traced", default=None)
# W3C traceparent: version, trace id (32 hex, not all zero), parent span id (16 hex, not all
# zero), flags; a later version may append fields after a dash (version 00 may not)
_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?$")
# W3C tracestate: at most 32 key=value members; anything else is dropped, not passed on
_VALUE_CHAR = r"\x21-\x2b\x2d-\x3c\x3e-\x7e"  # printable ASCII but ',' and '='
_MEMBER = rf"[a-z0-9][_0-9a-z\-*/@]{{0,255}}=[ {_VALUE_CHAR}]{{0,255}}[{_VALUE_CHAR}]"
_TRACESTATE = re.compile(rf"^{_MEMBER}(?:[ \t]*,[ \t]*{_MEMBER}){{0,31}}$")


@dataclass(frozen=True, slots=True)
class Parent:
    """The caller's span, from its `traceparent` (and `tracestate`) header."""

    trace_id: int
    span_id: int
    sampled: bool
    tracestate: str | None = None


def parse_traceparent(value: str | None, tracestate: str | None = None) -> Parent | None:
    """The caller's span, or None for a missing or malformed header (W3C Trace Context: a
    malformed traceparent is ignored, and the request starts a trace of its own)."""
    if not value:
        return None
    match = _TRACEPARENT.match(value.strip())
    if match is None or match[1] == "ff" or (match[1] == "00" and match[5]):
        return None
    trace_id, span_id = int(match[2], 16), int(match[3], 16)
    if trace_id == 0 or span_id == 0:
        return None
    if tracestate is not None and (len(tracestate) > 512 or not _TRACESTATE.match(tracestate)):
        tracestate = None
    return Parent(trace_id, span_id, bool(int(match[4], 16) & 1), tracestate)


class Sink(Protocol):
    """Where finished traces go (trace_export.OtlpSink; tests may pass their own)."""

    def write(self, trace: Trace) -> None: ...
    def shutdown(self, timeout: float) -> None: ...


class Trace:
    """One traced request: its span's name, times and attributes, and its steps' spans; written
    to the sink by end(). Times are time.perf_counter() seconds (CLOCK_MONOTONIC on Linux, the
    clock time.monotonic() reads too), turned into epoch nanoseconds with one offset."""

    __slots__ = (
        "attributes",
        "end_s",
        "error",
        "name",
        "offset",
        "parent",
        "sink",
        "span_id",
        "start",
        "steps",
        "trace_id",
    )

    def __init__(self, sink: Sink, parent: Parent | None, name: str, start: float) -> None:
        self.sink = sink
        self.parent = parent
        self.name = name
        self.start = start
        self.end_s = start
        self.attributes: dict[str, Any] = {}
        self.steps: list[tuple[str, float, float, dict[str, Any]]] = []
        self.error: tuple[str, str, str] | None = None  # (reason, message, exception type)
        # ids known from the start: the metrics' exemplar and the access log name the trace
        self.trace_id = parent.trace_id if parent is not None else random.getrandbits(128) or 1
        self.span_id = random.getrandbits(64) or 1  # the SERVER span's
        self.offset = time.time_ns() - time.perf_counter_ns()

    @property
    def hex_id(self) -> str:
        """The trace id as W3C and OTLP JSON write it: 32 lower-case hex digits."""
        return f"{self.trace_id:032x}"

    def ns(self, seconds: float) -> int:
        """Epoch nanoseconds of a time.perf_counter() reading."""
        return int(seconds * 1e9) + self.offset

    def step(self, name: str, start: float, end: float, **attributes: Any) -> None:
        """A child span from `start` to `end` (perf_counter seconds)."""
        self.steps.append((name, start, max(start, end), attributes))

    def fail(self, exc: BaseException) -> None:
        """Mark the request failed: status ERROR, with the reason the metrics record (a
        ServiceError's; a cancelled call: client_disconnected; anything else: inference_error)."""
        kind = type(exc).__name__
        if isinstance(exc, ServiceError):
            reason, message, status = exc.reason, exc.message, exc.status
        elif isinstance(exc, asyncio.CancelledError):
            reason, message, status = "client_disconnected", "the call was cancelled", 499
        else:
            reason, message, status = "inference_error", str(exc) or kind, 500
        self.error = (reason, message, kind)
        self.attributes["mha.status_code"] = status

    def end(self, end: float | None = None) -> None:
        """The request is over: write its spans (the sink queues them for export)."""
        self.end_s = time.perf_counter() if end is None else end
        try:
            self.sink.write(self)
        except Exception:  # tracing never fails a request
            log.exception("could not write the trace of %s", self.name)


def queue_and_compute(trace: Trace, work: Any) -> None:
    """A queued work's wait and its batch's forward as steps (their times are time.monotonic(),
    the same clock as perf_counter on Linux); nothing for work that never started."""
    if work.started_at is None:
        return
    trace.step("queue", work.enqueued_at, work.started_at)
    if work.infer_s:  # 0: its batch did not finish for it (failed, or it was withdrawn)
        attributes = {"mha.batch.sequences": work.batch_sequences} if work.batch_sequences else {}
        trace.step("compute", work.started_at, work.started_at + work.infer_s, **attributes)


def describe(trace: Trace, entry: Any, protocol: str, request_id: str) -> None:
    """The attributes every traced request's span has: its model, version, protocol and id."""
    trace.attributes.update(
        {
            "mha.model.name": entry.name,
            "mha.model.version": entry.version,
            "mha.protocol": protocol,
            "mha.request_id": request_id,
        }
    )


class Scope:
    """Trace settings (level, rate, count): all three for the global scope, the ones a model
    overrides for a model's; and the scope's sampling counter."""

    __slots__ = ("seen", "values")

    def __init__(self, values: dict[str, Any]) -> None:
        self.values = values
        self.seen = 0  # requests without a traceparent that reached this scope


class TraceControl:
    """The trace settings of one process (from its Settings; changed by Triton's trace
    extension) and the decision, per request, to trace it. A model's settings override the
    global ones one by one (a model that overrides none follows them)."""

    def __init__(
        self,
        level: str,
        rate: int,
        count: int,
        sink: Sink | None,
        updatable: bool,
        follow_callers: bool = True,
    ):
        self.sink = sink
        self.updatable = updatable
        # a caller's sampled flag decides (else its traceparent is only the parent: the rate does)
        self.follow_callers = follow_callers
        self.start_values = {"level": level, "rate": rate, "count": count}
        self.default = Scope(dict(self.start_values))
        self.models: dict[str, Scope] = {}  # models with settings of their own
        self.active = False  # any scope traces: read on every request
        self._refresh()

    @classmethod
    def off(cls) -> TraceControl:
        """No tracing (a state built without an app, as in the engine's own tests)."""
        return cls("OFF", 1000, -1, None, updatable=False)

    @classmethod
    def for_settings(cls, settings: Any, sink: Sink | None) -> TraceControl:
        level = settings.trace_level or ("TIMESTAMPS" if sink is not None else "OFF")
        rate, count, one = settings.trace_rate, settings.trace_count, settings.workers == 1
        return cls(level, rate, count, sink, one, follow_callers=settings.trace_callers)

    def _refresh(self) -> None:
        levels = [self.default.values["level"]]
        levels += [s.values["level"] for s in self.models.values() if "level" in s.values]
        self.active = self.sink is not None and any(level != "OFF" for level in levels)

    def _effective(self, model: str | None) -> dict[str, Any]:
        scope = self.models.get(model) if model else None
        return self.default.values if scope is None else {**self.default.values, **scope.values}

    # -- per request -------------------------------------------------------------------------
    def begin(
        self,
        model: str,
        operation: str,
        traceparent: str | None,
        tracestate: str | None = None,
        start: float | None = None,
    ) -> Trace | None:
        """A Trace for this request of `model` when it is to be traced, else None. Its span is
        named "`operation` `model`"; `start`: its perf_counter start (default: now)."""
        if not self.active:
            return None
        scope = self.models.get(model) or self.default
        values = scope.values
        level = values.get("level", self.default.values["level"])
        counted = scope if "count" in values else self.default  # whose trace_count is spent
        if level == "OFF" or counted.values["count"] == 0:
            return None
        parent = parse_traceparent(traceparent, tracestate)
        if parent is not None and self.follow_callers:
            if not parent.sampled:
                return None
        else:
            rated = scope if "rate" in values else self.default  # whose counter this is
            rated.seen += 1
            if rated.seen % rated.values["rate"]:
                return None
        if counted.values["count"] > 0:
            counted.values["count"] -= 1
        assert self.sink is not None  # active
        start = time.perf_counter() if start is None else start
        trace = Trace(self.sink, parent, f"{operation} {model}", start)
        TRACED.set(trace)
        return trace

    # -- Triton's trace extension ------------------------------------------------------------
    def snapshot(self, model: str | None = None) -> dict[str, Any]:
        """Triton's trace setting response for `model` (the global settings where it has
        none of its own) or the global scope: trace_level a list, the others strings."""
        values = self._effective(model)
        return {
            "trace_level": [values["level"]],
            "trace_rate": str(values["rate"]),
            "trace_count": str(values["count"]),
            **FIXED,
        }

    def update(self, changes: dict[str, Any], model: str | None = None) -> dict[str, Any]:
        """Apply Triton's trace setting request: only the settings named change; a value of
        None (or []) clears one (a model's follows the global value again, a global one gets
        its start-up value). BadInput names every problem, and then nothing changes. Returns
        the settings in force after it."""
        if not changes:
            return self.snapshot(model)
        if not self.updatable:
            raise BadInput(
                "trace settings cannot be changed with --workers > 1 (each front-end process "
                "has its own); restart with the flags instead"
            )
        unknown = sorted(set(changes) - set(SETTINGS))
        if unknown:
            raise BadInput(f"unknown trace setting(s) {unknown}; this server has {list(SETTINGS)}")
        parsed: dict[str, Any] = {}
        problems = []
        for name, value in changes.items():
            try:
                parsed[name] = _parse(name, value)
            except ValueError as exc:
                problems.append(str(exc))
        if parsed.get("trace_level") not in (None, "OFF") and self.sink is None:
            problems.append(
                "'trace_level' TIMESTAMPS needs somewhere to send spans: start the server "
                "with --otlp-endpoint"
            )
        if problems:
            raise BadInput("; ".join(problems))
        scope = self.models.setdefault(model, Scope({})) if model else self.default
        for name, value in parsed.items():
            if name in FIXED:
                continue
            key = name.removeprefix("trace_")
            if value is not None:
                scope.values[key] = value
            elif model:
                scope.values.pop(key, None)
            else:
                scope.values[key] = self.start_values[key]
            if key == "rate":
                scope.seen = 0
        if model and not scope.values:
            del self.models[model]
        self._refresh()
        log.info("trace settings changed%s: %s", f" for model {model!r}" if model else "", changes)
        return self.snapshot(model)

    def shutdown(self, timeout: float = 5.0) -> None:
        """Send what is queued (at the server's stop), waiting at most `timeout` seconds."""
        if self.sink is not None:
            self.sink.shutdown(timeout)


def _one(name: str, value: Any) -> Any:
    """A setting's single value: Triton's clients send strings, lists of strings, or numbers."""
    if isinstance(value, list):
        if len(value) != 1:
            raise ValueError(f"'{name}' takes one value, got {value!r}")
        value = value[0]
    return value


def _parse(name: str, value: Any) -> Any:
    """A setting's value as TraceControl keeps it (None: clear); ValueError saying why not."""
    if value is None or value == []:
        return None
    value = _one(name, value)
    if name == "trace_level":
        level = str(value).upper()
        if level == "TENSORS":
            raise ValueError("'trace_level' TENSORS is not supported: spans carry timestamps only")
        if level not in LEVELS:
            raise ValueError(f"'trace_level' must be one of {list(LEVELS)}, got {value!r}")
        return level
    if name in FIXED:
        if str(value) != FIXED[name]:
            raise ValueError(
                f"'{name}' can only be {FIXED[name]!r} here (spans go to the OTLP endpoint, "
                f"--otlp-endpoint), got {value!r}"
            )
        return value
    number = _integer(name, value)
    if name == "trace_rate" and number < 1:
        raise ValueError(f"'trace_rate' must be an integer >= 1, got {value!r}")
    if name == "trace_count" and number < -1:
        raise ValueError(f"'trace_count' must be -1 (no limit) or an integer >= 0, got {value!r}")
    return number


def _integer(name: str, value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError(f"'{name}' must be an integer, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, str) and re.fullmatch(r"-?[0-9]{1,18}", value.strip()):
        return int(value)
    raise ValueError(f"'{name}' must be an integer, got {value!r}")
