"""`--workers` metrics: with PROMETHEUS_MULTIPROC_DIR set, every process's values merge, so a
scrape of any front-end shows the whole server (service.runtime.metrics). Real processes write the
values; a fresh one scrapes, as a front-end answering /metrics would."""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from service.oip.inputs import Payload
from service.runtime import metrics as metrics_module
from service.runtime.exposition import mark_process_dead
from service.runtime.metrics import MODEL_INFO_LABELS, Metrics
from service.runtime.work import Work

ROOT = Path(__file__).resolve().parents[2]
ROLES = ("front_a", "front_b", "engine")
# mha_model_info's labels as the engine sets them (their keys are checked against
# service.runtime.loading.model_info below)
INFO = {
    "name": "m", "architecture": "transformer_encoder", "embed_dim": 512, "num_heads": 8,
    "num_layers": 1, "dtype": "float32", "device": "cpu", "sdpa_backend": "math",
    "cpu_capability": "AVX512",
}  # fmt: skip

Series = dict[tuple[str, frozenset[tuple[str, str]]], float]


def _work(lengths: list[int], loop: asyncio.AbstractEventLoop) -> Work:
    """A queued request of `lengths` sequences that waited 4 ms."""
    payload = Payload(np.zeros((sum(lengths), 4), np.float32), lengths)
    return Work(
        payload=payload, runner=lambda model, payloads: [], deadline=0.0, loop=loop,
        enqueued_at=100.0, started_at=100.004,
    )  # fmt: skip


def play(metrics: Metrics, role: str) -> None:
    """What one process of a `--workers` server records: front-ends answer requests, the engine
    loads the model and runs batches."""
    if role == "front_a":
        for _ in range(3):
            metrics.request_done("infer", 200, 0.003, None)
        metrics.request_done("infer", 400, 0.0004, "bad_input")
        metrics.sequences_received([4, 8])
        metrics.codec(metrics.decode, "http", 0.0002)
        metrics.codec(metrics.encode, "http", 0.0003)
        metrics.in_flight_child.inc()
        metrics.set_ready(True)
    elif role == "front_b":  # still starting: its mha_ready stays at 0
        metrics.request_done("infer", 200, 0.02, None, protocol="grpc")
        metrics.request_done("infer", 200, 0.005, None)
        metrics.sequences_received([16])
        metrics.codec(metrics.decode, "grpc", 0.0001)
        metrics.codec(metrics.encode, "grpc", 0.0001)
        metrics.in_flight_child.inc(2)
    else:
        metrics.set_model_info(INFO)
        metrics.set_queue_capacity(64)
        loop = asyncio.new_event_loop()
        works = [_work([4, 8], loop), _work([16], loop)]
        metrics.batch_started(works)
        metrics.batch_done(works, 0.002, ok=True)
        failed = [_work([3], loop)]
        metrics.batch_started(failed)
        metrics.batch_done(failed, 0.001, ok=False)
        metrics.queue_depth(5)
        loop.close()


def record(role: str) -> None:
    """Subprocess entry: one process's Metrics, as in the server; prints the pid."""
    play(Metrics("m", "1"), role)
    print(os.getpid())


def scrape_all() -> None:
    """Subprocess entry: once the writers' pids arrive on stdin (the writers have exited), the
    merged exposition, and again after each of those pids is marked dead."""
    metrics = Metrics("m", "1")
    pids = sys.stdin.readline().split()
    texts = [metrics.exposition()[0].decode()]
    for pid in pids:
        mark_process_dead(int(pid))  # PROMETHEUS_MULTIPROC_DIR from the environment
        texts.append(metrics.exposition()[0].decode())
    print(json.dumps(texts))


def python(code: str, multiproc_dir: Path) -> subprocess.Popen[str]:
    """Run `code` with this module's names in a process in multiprocess mode."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PROMETHEUS_MULTIPROC_DIR": str(multiproc_dir)}
    module = "tests.service.test_metrics_multiprocess"
    return subprocess.Popen(
        [sys.executable, "-c", f"from {module} import *; {code}"],
        env=env, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip


def output(process: subprocess.Popen[str], stdin: str = "") -> str:
    out, _ = process.communicate(stdin, timeout=60)
    assert process.returncode == 0, out
    return out


def parse(text: str) -> tuple[dict[str, str], Series]:
    """({family: type}, {(sample name, labels): value}) of the mha_ families, less `_created`."""
    types, series = {}, {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("mha_") or family.name.endswith("_created"):
            continue
        types[family.name] = family.type
        for s in family.samples:
            series[(s.name, frozenset(s.labels.items()))] = s.value
    return types, series


def value(series: Series, name: str, **labels: str) -> float | None:
    """The sum of the samples `name` whose labels include `labels` (None if there are none)."""
    found = [v for (n, ls), v in series.items() if n == name and set(labels.items()) <= ls]
    return sum(found) if found else None


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """Three writer processes at once (two front-ends, the engine), and here, as a reference,
    every role in one process in single-process mode (as the tests run); then one scrape, again
    with front_a marked dead, again with the engine too (the reader starts with the writers, to
    overlap the imports, and waits for their pids)."""
    assert not metrics_module.MULTIPROCESS, "run the tests without PROMETHEUS_MULTIPROC_DIR"
    directory = tmp_path_factory.mktemp("multiproc")
    writers = {role: python(f"record({role!r})", directory) for role in ROLES}
    reader = python("scrape_all()", directory)
    try:
        reference = Metrics("m", "1")
        for role in ROLES:
            play(reference, role)
        single = reference.exposition()[0].decode()
        pids = {role: int(output(p)) for role, p in writers.items()}
        merged, front_a_dead, engine_dead = json.loads(
            output(reader, f"{pids['front_a']} {pids['engine']}\n")
        )
    finally:  # a failed writer leaves the reader waiting for pids
        for process in (*writers.values(), reader):
            if process.poll() is None:
                process.kill()
                process.wait()
    return {
        "single": single, "merged": merged, "front_a_dead": front_a_dead,
        "engine_dead": engine_dead, "directory": directory, "pids": pids,
    }  # fmt: skip


def test_merged_scrape_equals_one_process_doing_all_the_work(run: dict) -> None:
    """Counters and histograms summed over processes, gauges merged per their mode: the same
    families, series and values as one process that recorded everything."""
    single_types, single = parse(run["single"])
    merged_types, merged = parse(run["merged"])
    assert merged_types == single_types
    assert merged.keys() == single.keys()
    for key, expected in single.items():
        assert math.isclose(merged[key], expected, rel_tol=1e-9), key


def test_request_counters_are_summed_over_front_ends(run: dict) -> None:
    merged = parse(run["merged"])[1]
    assert value(merged, "mha_requests_total", status="200", protocol="http") == 4
    assert value(merged, "mha_requests_total", status="200", protocol="grpc") == 1
    assert value(merged, "mha_request_failures_total", reason="bad_input") == 1
    assert value(merged, "mha_request_duration_seconds_count", status_class="2xx") == 5
    assert value(merged, "mha_request_sequence_length_count") == 3
    assert value(merged, "mha_requests_in_flight") == 3  # 1 + 2


def test_engine_metrics_come_through_once(run: dict) -> None:
    types, merged = parse(run["merged"])
    assert value(merged, "mha_batches_total", outcome="ok") == 1
    assert value(merged, "mha_batches_total", outcome="error") == 1
    assert value(merged, "mha_sequences_processed_total") == 3
    assert value(merged, "mha_tokens_processed_total") == 28
    assert value(merged, "mha_batch_size_sequences_count") == 1
    assert value(merged, "mha_batch_size_sequences_bucket", le="2.0") == 0
    assert value(merged, "mha_batch_size_sequences_bucket", le="4.0") == 1
    assert value(merged, "mha_queue_wait_seconds_count") == 3  # 2 in the batch, 1 failed alone
    assert value(merged, "mha_queue_depth_sequences") == 5
    assert value(merged, "mha_queue_capacity_sequences") == 64
    assert value(merged, "mha_engine_busy") == 0
    assert types["mha_model_info"] == "gauge"
    (info,) = [dict(ls) for (n, ls) in merged if n == "mha_model_info"]
    assert info == {"model": "m", "version": "1", **{k: str(v) for k, v in INFO.items()}}
    assert merged[("mha_model_info", frozenset(info.items()))] == 1


def test_dead_processes_gauges_vanish_and_counters_stay(run: dict) -> None:
    merged = parse(run["merged"])[1]
    assert value(merged, "mha_ready") == 1  # front_a said ready; front_b's start-up 0 is no veto
    after = parse(run["front_a_dead"])[1]
    assert value(after, "mha_requests_in_flight") == 2  # front_b's
    assert value(after, "mha_ready") == 0  # front_a's stale 1 is gone
    assert value(after, "mha_requests_total", status="200", protocol="http") == 4
    assert value(after, "mha_model_info") == 1
    gone = parse(run["engine_dead"])[1]
    assert value(gone, "mha_model_info") is None
    assert value(gone, "mha_queue_capacity_sequences") is None
    assert value(gone, "mha_queue_depth_sequences") == 0  # the live processes' zeros
    assert value(gone, "mha_batches_total", outcome="ok") == 1


def test_mark_process_dead_takes_the_directory_or_does_nothing(
    run: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The supervisor may not have the variable itself: it passes the directory; with neither,
    nothing happens (single-process mode)."""
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    directory, pid = run["directory"], run["pids"]["front_b"]
    live = sorted(p.name for p in directory.glob(f"gauge_live*_{pid}.db"))
    assert live and all(p.startswith(("gauge_livesum", "gauge_livemax")) for p in live)
    mark_process_dead(pid)  # no variable in this process: a no-op
    assert sorted(p.name for p in directory.glob(f"gauge_live*_{pid}.db")) == live
    mark_process_dead(pid, directory)
    assert not list(directory.glob(f"gauge_live*_{pid}.db"))
    assert list(directory.glob(f"counter_{pid}.db"))  # its counts stay


def test_single_process_mode_keeps_the_process_collectors(run: dict) -> None:
    """Without the variable (today's default) the process, gc and platform collectors and the
    `_created` series stay; the merged scrape has none of them."""
    names = {f.name for f in text_string_to_metric_families(run["single"])}
    assert {"process_cpu_seconds", "python_gc_objects_collected", "python_info"} <= names
    assert "mha_requests_created" in names
    merged = {f.name for f in text_string_to_metric_families(run["merged"])}
    assert not any(n.startswith(("process_", "python_")) or n.endswith("_created") for n in merged)


def test_model_info_labels_match_what_loading_publishes() -> None:
    import mha_engine
    from service.runtime.loading import model_info

    info = model_info(mha_engine.build_demo_model(device="cpu"), "m")
    assert set(info) == set(MODEL_INFO_LABELS) == set(INFO)
    with pytest.raises(ValueError, match="MODEL_INFO_LABELS"):
        Metrics("m", "1").set_model_info({**info, "extra": "x"})
