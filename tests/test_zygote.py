"""The suite's fork server (tests/zygote.py): which servers it forks, and that a forked server
is read and stopped like a subprocess."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import pytest

from tests.support import ROOT, forked, free_port, run_server, wait_for
from tests.zygote import LOST, ForkedProcess, Zygote, zygote

pytestmark = pytest.mark.skipif(
    os.environ.get("MHA_TEST_FRESH_SERVERS") == "1", reason="MHA_TEST_FRESH_SERVERS=1"
)


def test_a_forked_server_serves_and_reports_how_it_ended(tmp_path: Path) -> None:
    with run_server(tmp_path) as server:
        process = server.process
        assert isinstance(process, ForkedProcess)
        assert f"Started server process [{process.pid}]" in server.log()
        assert httpx.get(f"{server.url}/v2/health/ready").status_code == 200
        assert process.poll() is None
        process.send_signal(signal.SIGKILL)
        assert process.wait(timeout=30) == -signal.SIGKILL
        process.send_signal(signal.SIGTERM)  # gone: nothing is signalled
    assert process.returncode == -signal.SIGKILL


def test_an_error_exit_keeps_its_status_and_its_message(tmp_path: Path) -> None:
    expected = pytest.raises(RuntimeError, match=r"exited with 2:[\s\S]*--max-batch-size")
    with expected, run_server(tmp_path, "--max-batch-size", "0"):
        pass


def test_servers_whose_start_differs_start_fresh(tmp_path: Path) -> None:
    fork_server = zygote(ROOT)
    assert fork_server is not None
    env = dict(fork_server.env)
    assert fork_server.loaded == []  # so the HF_* and TORCHINDUCTOR_* variables may differ
    assert fork_server.can_fork({**env, "MHA_MAX_BATCH_SIZE": "4", "HF_HUB_OFFLINE": "1"})
    assert fork_server.can_fork({**env, "TMPDIR": str(tmp_path)})
    assert not fork_server.can_fork({**env, "OMP_NUM_THREADS": "1"})
    assert not fork_server.can_fork({**env, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)})
    assert forked(["--workers", "2"], env, tmp_path / "log") is None
    assert forked([], {**env, "MHA_WORKERS": "2"}, tmp_path / "log") is None


def test_a_fork_outliving_its_fork_server_is_still_waited_for(tmp_path: Path) -> None:
    """Should the fork server die, its children's exits go unreported: wait() then learns the
    end from the child's pidfd (status LOST) instead of blocking until pytest-timeout."""
    fork_server = Zygote(ROOT)  # its own, not the suite's
    process = fork_server.fork(["--port", str(free_port())], fork_server.env, str(tmp_path / "log"))
    try:
        fork_server.process.kill()
        fork_server.process.wait(timeout=30)
        assert wait_for(lambda: fork_server.dead, timeout=10)
        assert process.poll() is None  # the server runs on, orphaned
        process.kill()
        assert process.wait(timeout=30) == LOST
    finally:
        process.kill()  # through its pidfd: never another process
