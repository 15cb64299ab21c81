"""`--workers 2` under faults, as real processes: the engine killed (-9) mid-load, a front-end
killed (-9) while the other serves, SIGTERM under load, the supervisor killed (-9). Requests get
200 or 503 + Retry-After (never a 500, never a hang), the dead process is restarted and readiness
returns; nothing leaks: no /dev/shm entry, no slab mapped for a dead front-end, no temp dir after
a clean exit, no child process left behind.

Each server gets its own TMPDIR so its `mha-serve-*` directory can be watched.
"""

from __future__ import annotations

import http.client
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import tritonclient.grpc as tgrpc
from tritonclient.utils import InferenceServerException

import mha_engine
from service.runtime.startup import EXIT_MODEL_LOAD
from tests.support import (
    FP32_TOL,
    Server,
    alive,
    binary_output,
    child_pids,
    descendant_pids,
    fp32_request,
    free_port,
    listening_inodes,
    run_server,
    serving_pid,
    slab_inodes,
    socket_inodes,
    wait_for,
    worker_pids,
)

INFER = "/v2/models/mha/infer"


def frontends(server: Server) -> dict[str, int]:
    return {n: p for n, p in worker_pids(server).items() if n.startswith("mha-frontend")}


def shm_paths(pid: int) -> list[str]:
    """Named shared memory (/dev/shm) the process maps or holds open."""
    found = []
    try:
        maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
        found += [line for line in maps if "/dev/shm" in line]
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                if os.readlink(fd).startswith("/dev/shm"):
                    found.append(str(fd))
            except OSError:
                pass
    except OSError:
        pass
    return found


def slabs_match(server: Server) -> bool:
    """The engine maps exactly the slabs of the live front-ends, one each."""
    pids = worker_pids(server)
    fe = [slab_inodes(p) for n, p in pids.items() if n.startswith("mha-frontend") and alive(p)]
    if len(fe) != 2 or any(len(s) != 1 for s in fe):
        return False
    return slab_inodes(pids["mha-engine"]) == set().union(*fe)


def send(server: Server, x: np.ndarray) -> http.client.HTTPConnection:
    """POST `x` on a new connection; read the answer later with getresponse()."""
    content, headers = fp32_request(x)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", INFER, body=content, headers=headers)
    return conn


def in_app(server: Server, conns: list[http.client.HTTPConnection]) -> bool:
    """Every connection accepted by a front-end that has read all it was sent."""
    pids = frontends(server).values()
    return all(serving_pid(server.port, c.sock.getsockname()[1], pids) for c in conns)


def refused(server: Server) -> bool:
    """A new connection is refused (True), or served (False: not yet draining); one accepted
    and then left unanswered (a listening socket no one accepts on) fails the test. A front-end
    that accepted it just as it stopped closes it at once, unanswered (uvicorn's shutdown closes
    connections whose request has not started, as one process does): not yet refused."""
    started = time.monotonic()
    try:
        httpx.get(f"{server.url}/v2/health/live", timeout=3)
    except httpx.ConnectError:
        return True
    except (httpx.RemoteProtocolError, httpx.ReadError) as exc:
        if time.monotonic() - started < 1.0:
            return False
        raise AssertionError(f"a new connection during the drain hung: {exc!r}") from exc
    except httpx.HTTPError as exc:
        raise AssertionError(f"a new connection during the drain hung: {exc!r}") from exc
    return False


def demo(x: np.ndarray) -> torch.Tensor:
    with torch.no_grad():
        return mha_engine.demo_module().eval()(torch.from_numpy(x))


@pytest.fixture(scope="module")
def tmpdir_env(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tmpdir")
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tmpdir_env: Path) -> Iterator[Server]:
    """One sequence per forward, so long requests queue behind each other."""
    grpc_port = free_port()
    args = ("--workers", "2", "--max-batch-size", "1", "--max-batch-delay-ms", "0",
            "--grpc-port", str(grpc_port))  # fmt: skip
    env = {"TMPDIR": str(tmpdir_env)}
    shm_before = set(os.listdir("/dev/shm"))
    with run_server(tmp_path_factory.mktemp("faults"), *args, env=env) as server:
        server.grpc_port = grpc_port  # type: ignore[attr-defined]
        server.shm_before = shm_before  # type: ignore[attr-defined]
        wait_for(lambda: slabs_match(server), "both front-ends connected", 60)
        yield server


def test_engine_killed_is_503_then_restarted_and_ready_again(server: Server) -> None:
    old = worker_pids(server)["mha-engine"]
    shm_before = set(os.listdir("/dev/shm"))
    x = np.random.default_rng(0).standard_normal((1, 1024, 512)).astype(np.float32)
    conns = [send(server, x) for _ in range(6)]  # ~6 forwards of work, one at a time
    wait_for(lambda: in_app(server, conns), "the requests reached the front-ends", 30)
    os.kill(old, signal.SIGKILL)
    # while the engine is down, new requests are 503 + Retry-After at once, and not ready
    small = np.ones((1, 4, 512), np.float32)
    content, headers = fp32_request(small)
    down = httpx.post(f"{server.url}{INFER}", content=content, headers=headers, timeout=10)
    assert down.status_code == 503, down.text
    assert down.headers["Retry-After"] == "1", down.headers
    assert down.json()["error"] == "the engine process is restarting; retry shortly", down.text
    client = tgrpc.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")  # type: ignore[attr-defined]
    item = tgrpc.InferInput("input", list(small.shape), "FP32")
    item.set_data_from_numpy(small)
    with pytest.raises(InferenceServerException) as refused:
        client.infer("mha", [item], client_timeout=10)
    assert refused.value.status() == "StatusCode.UNAVAILABLE", refused.value
    client.close()
    assert httpx.get(f"{server.url}/v2/health/ready", timeout=10).status_code == 503
    assert httpx.get(f"{server.url}/v2/health/live", timeout=10).status_code == 200
    statuses = []
    for conn in conns:  # those in flight: answered (200 if done before the kill, else 503)
        response = conn.getresponse()
        raw = response.read()
        statuses.append(response.status)
        if response.status == 503:
            assert response.getheader("Retry-After") == "1", raw
        else:
            assert response.status == 200, raw
        conn.close()
    assert 503 in statuses, statuses
    # restarted: a new engine, both front-ends ready again and serving the module's numbers
    wait_for(lambda: worker_pids(server)["mha-engine"] != old, "engine restarted", 30)
    assert not alive(old)

    def ready_everywhere() -> bool:
        probes = [httpx.get(f"{server.url}/v2/health/ready", timeout=10) for _ in range(10)]
        return all(p.status_code == 200 for p in probes)

    wait_for(ready_everywhere, "readiness back on both front-ends", 60)
    y = np.random.default_rng(1).standard_normal((1, 9, 512)).astype(np.float32)
    content, headers = fp32_request(y)
    for _ in range(6):
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        conn.request("POST", INFER, body=content, headers=headers)
        response = conn.getresponse()
        raw = response.read()
        assert response.status == 200, raw
        got = binary_output(raw, response.headers)
        torch.testing.assert_close(torch.from_numpy(got), demo(y), **FP32_TOL)
        conn.close()
    # the new engine maps the front-ends' new slabs, and they dropped their old ones
    wait_for(lambda: slabs_match(server), "one slab per live front-end", 10)
    assert set(os.listdir("/dev/shm")) <= shm_before  # the crash left no named segment
    log = server.log()
    assert "Traceback" not in log and f"{INFER} 500" not in log, log[-3000:]


def test_frontend_killed_is_restarted_and_the_other_keeps_serving(server: Server) -> None:
    fe = frontends(server)
    victim = fe["mha-frontend-0"]
    victim_slab = slab_inodes(victim)
    assert len(victim_slab) == 1
    x = np.random.default_rng(2).standard_normal((1, 8, 512)).astype(np.float32)
    content, headers = fp32_request(x)
    # a keep-alive connection held by the other front-end
    pinned = None
    for _ in range(100):
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        conn.request("GET", "/v2/health/live")
        conn.getresponse().read()
        if serving_pid(server.port, conn.sock.getsockname()[1], [fe["mha-frontend-1"]]):
            pinned = conn
            break
        conn.close()
    assert pinned is not None, "no connection reached front-end 1"

    def request(conn: http.client.HTTPConnection) -> int:
        conn.request("POST", INFER, body=content, headers=headers)
        response = conn.getresponse()
        response.read()
        return response.status

    statuses = [request(pinned) for _ in range(3)]
    # long requests in flight on both front-ends, queued in the engine when the victim dies
    long = np.random.default_rng(5).standard_normal((1, 1024, 512)).astype(np.float32)
    in_flight = [send(server, long) for _ in range(6)]
    wait_for(lambda: in_app(server, in_flight), "the requests reached the front-ends", 30)
    survivor = [
        c
        for c in in_flight
        if serving_pid(server.port, c.sock.getsockname()[1], [fe["mha-frontend-1"]])
    ]
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: not alive(victim), "front-end 0 dead", 10)
    # the other serves on, its kept connection and new ones (the listening socket is shared)
    while True:
        statuses.append(request(pinned))
        fresh = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        statuses.append(request(fresh))
        fresh.close()
        if frontends(server)["mha-frontend-0"] != victim:  # restarted
            break
        assert len(statuses) < 2000, "front-end 0 was not restarted"
    assert set(statuses) == {200}, statuses
    for conn in survivor:  # the other front-end's long requests are unharmed
        response = conn.getresponse()
        assert response.status == 200, response.read()
    for conn in in_flight:
        conn.close()
    # the engine let go of the dead front-end's slab (its queued work withdrawn, its running
    # work finished); the new front-end connects with its own
    wait_for(lambda: slabs_match(server), "one slab per live front-end", 30)
    assert not victim_slab & slab_inodes(worker_pids(server)["mha-engine"])
    new = frontends(server)["mha-frontend-0"]
    for _ in range(200):  # and the new front-end serves
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        status = request(conn)
        on_new = serving_pid(server.port, conn.sock.getsockname()[1], [new])
        conn.close()
        if on_new:
            assert status == 200
            break
    else:
        raise AssertionError("the restarted front-end answered none of 200 new connections")
    pinned.close()
    # its gRPC listener is back on the shared port beside the other's
    grpc_port = server.grpc_port  # type: ignore[attr-defined]
    wait_for(lambda: listening_inodes(grpc_port) & socket_inodes(new), "gRPC listener back", 30)
    assert len(listening_inodes(grpc_port)) == 2
    for _ in range(4):
        client = tgrpc.InferenceServerClient(f"127.0.0.1:{grpc_port}")
        item = tgrpc.InferInput("input", list(x.shape), "FP32")
        item.set_data_from_numpy(x)
        got = client.infer("mha", [item]).as_numpy("output").copy()
        torch.testing.assert_close(torch.from_numpy(got), demo(x), **FP32_TOL)
        client.close()


def test_supervisor_killed_takes_its_children_down(server: Server, tmpdir_env: Path) -> None:
    """kill -9 of the supervisor: the engine and front-ends notice, drain and exit by themselves,
    and the engine removes the run's temp dir."""
    children = descendant_pids(server.process.pid)
    assert set(worker_pids(server).values()) <= children, children
    for pid in children:  # tensors go through memfd slabs: no named shared memory at all
        assert shm_paths(pid) == [], shm_paths(pid)
    server.process.kill()
    server.process.wait(10)
    for pid in children:
        wait_for(lambda pid=pid: not alive(pid), f"child {pid} exited", 15)
    assert set(os.listdir("/dev/shm")) <= server.shm_before  # type: ignore[attr-defined]
    assert list(tmpdir_env.glob("mha-serve-*")) == []


def test_sigterm_drains_every_process_and_leaves_nothing(tmp_path: Path) -> None:
    """Requests in flight at SIGTERM all get 200; every process exits within the grace; no
    temp dir, /dev/shm entry or child process remains."""
    grace_s = 15.0
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    shm_before = set(os.listdir("/dev/shm"))
    args = ("--workers", "2", "--max-batch-size", "1", "--max-batch-delay-ms", "0",
            "--drain-grace-s", str(grace_s))  # fmt: skip
    x = np.random.default_rng(3).standard_normal((1, 1024, 512)).astype(np.float32)
    with run_server(tmp_path, *args, env={"TMPDIR": str(tmpdir)}) as server:
        wait_for(lambda: slabs_match(server), "both front-ends connected", 60)
        children = descendant_pids(server.process.pid)
        assert set(worker_pids(server).values()) <= children, children
        assert len(list(tmpdir.glob("mha-serve-*"))) == 1
        for pid in children:  # tensors go through memfd slabs: no named shared memory at all
            assert shm_paths(pid) == [], shm_paths(pid)
        conns = [send(server, x) for _ in range(6)]
        wait_for(lambda: in_app(server, conns), "the requests reached the front-ends", 30)
        server.process.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        wait_for(lambda: refused(server), "new connections refused while draining", 10)
        statuses = []
        for conn in conns:
            response = conn.getresponse()
            raw = response.read()
            statuses.append(response.status)
            if response.status == 200:
                got = binary_output(raw, response.headers)
                torch.testing.assert_close(torch.from_numpy(got), demo(x), **FP32_TOL)
        try:
            code = server.process.wait(grace_s + 10)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running {grace_s + 10} s after SIGTERM") from None
        exit_after = time.monotonic() - sent
        log = server.log()
    assert statuses == [200] * len(conns), (statuses, log[-3000:])
    assert exit_after < grace_s, exit_after  # the work took less than the grace
    assert code == 0, (code, log[-3000:])
    for pid in children:
        wait_for(lambda pid=pid: not alive(pid), f"child {pid} exited", 5)
    assert list(tmpdir.iterdir()) == []  # the supervisor's mha-serve-* directory is gone
    assert set(os.listdir("/dev/shm")) <= shm_before
    assert "Traceback" not in log and " 500" not in log, log[-3000:]


def test_sigterm_past_the_grace_sheds_the_engine_queue_with_503(tmp_path: Path) -> None:
    """Work not started when the grace ends is answered 503 + Retry-After by the engine and never
    computed; what started finishes; every process exits within about the grace."""
    grace_s = 1.0
    # One engine thread: a forward slow enough that the queue outlasts the grace on fast CPUs
    # too (on a 2-core AVX-512 EPYC, 48 two-thread forwards fit in the time it was given)
    args = ("--workers", "2", "--max-batch-size", "1", "--max-batch-delay-ms", "0",
            "--threads", "1", "--drain-grace-s", str(grace_s),
            "--request-timeout-s", "120")  # fmt: skip
    x = np.random.default_rng(4).standard_normal((1, 1024, 512)).astype(np.float32)
    with run_server(tmp_path, *args) as server:
        wait_for(lambda: slabs_match(server), "both front-ends connected", 60)
        times = []
        for _ in range(3):  # the fastest of three: a cold first one would overstate it
            started = time.monotonic()
            assert send(server, x).getresponse().status == 200
            times.append(time.monotonic() - started)
        forward_s = min(times)
        n = min(64, int(3 * grace_s / forward_s) + 4)  # about three graces of work
        conns = [send(server, x) for _ in range(n)]
        wait_for(lambda: in_app(server, conns), "the requests reached the front-ends", 30)
        children = descendant_pids(server.process.pid)
        assert set(worker_pids(server).values()) <= children, children
        server.process.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        statuses = []
        for conn in conns:
            response = conn.getresponse()
            raw = response.read()
            statuses.append(response.status)
            if response.status == 503:
                assert response.getheader("Retry-After") == "1", raw
                assert b"shutting down" in raw or b"draining" in raw, raw
        code = server.process.wait(grace_s + 30)
        exit_after = time.monotonic() - sent
        log = server.log()
    assert set(statuses) == {200, 503}, statuses
    for pid in children:
        wait_for(lambda pid=pid: not alive(pid), f"child {pid} exited", 5)
    assert exit_after < grace_s + 2 * forward_s + 3.0, (exit_after, forward_s)
    assert code == 0, (code, log[-3000:])
    shed = re.search(r"drain grace over: (\d+) queued requests answered 503, not computed", log)
    assert shed and int(shed.group(1)) == statuses.count(503), log[-3000:]
    assert "Traceback" not in log and " 500" not in log, log[-3000:]


def test_an_engine_that_never_serves_stops_the_server(tmp_path: Path) -> None:
    """A model that cannot load: the supervisor stops (with the engine's status for it, 6, and
    its one line) rather than restart the engine forever, and leaves no process, temp dir or
    /dev/shm entry behind."""
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"architecture": "multihead_attention"}')  # no weights
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    shm_before = set(os.listdir("/dev/shm"))
    args = ("--workers", "2", "--model-dir", str(broken))
    with run_server(tmp_path, *args, env={"TMPDIR": str(tmpdir)}, wait=False) as server:
        children = wait_for(lambda: descendant_pids(server.process.pid), "children started", 30)
        code = server.process.wait(60)
        log = server.log()
    assert code == EXIT_MODEL_LOAD, (code, log[-3000:])
    assert "the engine process failed before it could serve; stopping" in log, log[-3000:]
    assert f"mha-serve: error: model 'broken' at {broken} failed to load" in log, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    for pid in children:  # type: ignore[union-attr]
        wait_for(lambda pid=pid: not alive(pid), f"child {pid} exited", 5)
    assert list(tmpdir.iterdir()) == []
    assert set(os.listdir("/dev/shm")) <= shm_before


def test_spawned_children_serve_and_go_when_the_supervisor_is_killed(tmp_path: Path) -> None:
    """--worker-start spawn: the engine and front-ends are fresh interpreters, children of the
    supervisor itself; they serve the same numbers and leave with a killed supervisor."""
    args = ("--workers", "2", "--worker-start", "spawn")
    with run_server(tmp_path, *args) as server:
        workers = set(worker_pids(server).values())
        assert len(workers) == 3 and workers <= child_pids(server.process.pid), workers
        x = np.random.default_rng(5).standard_normal((1, 16, 512)).astype(np.float32)
        response = send(server, x).getresponse()
        assert response.status == 200
        got = binary_output(response.read(), response.headers)
        torch.testing.assert_close(torch.from_numpy(got), demo(x), **FP32_TOL)
        server.process.kill()
        server.process.wait(10)
        for pid in workers:
            wait_for(lambda pid=pid: not alive(pid), f"child {pid} exited", 15)


def test_the_fork_servers_preload_touches_neither_cuda_nor_metrics() -> None:
    """--worker-start forkserver imports PRELOAD once, in the process every child forks from: it
    must not start CUDA (a forked CUDA runtime is unusable) nor create a prometheus_client
    metric (its value files would carry the fork server's pid into every scrape)."""
    code = "\n".join([
        "import sys, torch",
        "def refuse(*args, **kwargs): raise AssertionError('CUDA used while preloading')",
        "for name in ('is_available', 'device_count', 'init', '_lazy_init'):",
        "    setattr(torch.cuda, name, refuse)",
        "from service.workers.supervisor import PRELOAD",
        "assert 'prometheus_client' not in sys.modules",
        "for name in PRELOAD:",
        "    __import__(name)",
        "assert not torch.cuda.is_initialized()",
        "assert 'prometheus_client' not in sys.modules, 'the preload imports prometheus_client'",
        "print(sorted(PRELOAD))",
    ])  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "mha_engine" in done.stdout and "torch" in done.stdout, done.stdout
