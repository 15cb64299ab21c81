"""`--workers 2` as real processes (a supervisor, an engine, two front-ends on one port), driven by
unmodified clients: everything a single process does keeps working, whichever front-end answers.

Which front-end answered is told by the request id it generated (a random prefix per process),
so the tests check both served. Two servers: one with three models and every option on (the
demo encoder, a small MultiheadAttention for the debug endpoint, all-MiniLM-L6-v2 when
installed; --debug-endpoint, --api-key, --grpc-port), one with a 1 MiB slab and a tiny queue.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import tritonclient.grpc as tgrpc
import tritonclient.http as triton
from torch import nn
from tritonclient.utils import InferenceServerException

import mha_engine
from benchmarks import scrape
from benchmarks.server import proc_cpu
from tests.support import (
    FP32_TOL,
    Server,
    fp32_request,
    free_port,
    listening_inodes,
    output_of,
    run_server,
    serving_pid,
    socket_inodes,
    wait_for,
    worker_pids,
)

KEY = "workers-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
INFER = "/v2/models/mha/infer"
MINILM = "all-MiniLM-L6-v2"
E, H = 32, 4  # the debug endpoint's MultiheadAttention


@dataclass
class Workers:
    server: Server
    grpc_port: int
    attn: nn.Module
    minilm: Path | None

    @property
    def url(self) -> str:
        return self.server.url


def _minilm() -> Path | None:
    from service.text.tokenizer import minilm_path

    return minilm_path()


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workers]:
    """Three models behind two front-ends, with the debug endpoint, an API key and gRPC."""
    root = tmp_path_factory.mktemp("workers")
    mha_engine.save_model(mha_engine.demo_module(), root / "mha")
    torch.manual_seed(0)
    attn = nn.MultiheadAttention(E, H, batch_first=True).eval()
    mha_engine.save_model(attn, root / "attn")
    dirs = [root / "attn", root / "mha"]  # the debug routes serve the first model
    minilm = _minilm()
    if minilm is not None:  # served under its model card's name: a directory of links to it
        (root / MINILM).mkdir()
        for item in minilm.iterdir():
            (root / MINILM / item.name).symlink_to(item)
        dirs.append(root / MINILM)
    grpc_port = free_port()
    args = ["--workers", "2", "--debug-endpoint", "--api-key", KEY, "--grpc-port", str(grpc_port)]
    for d in dirs:
        args += ["--model-dir", str(d)]
    with run_server(root, *args) as server:
        wait_all_ready(server)
        yield Workers(server, grpc_port, attn, minilm)


def wait_all_ready(server: Server, timeout: float = 60) -> None:
    """Until 10 readiness probes in a row (new connections: either front-end) answer 200."""
    deadline = time.monotonic() + timeout
    streak = 0
    while streak < 10:
        assert time.monotonic() < deadline, server.log()[-3000:]
        ok = httpx.get(f"{server.url}/v2/health/ready", timeout=5).status_code == 200
        streak = streak + 1 if ok else 0
        if not ok:
            time.sleep(0.1)


def prefix(response: httpx.Response) -> str:
    """The answering process's part of a generated request id."""
    return response.headers["x-request-id"].rsplit("-", 1)[0]


def each_frontend(send, tries: int = 100) -> list[httpx.Response]:
    """`send()` (a request on a new connection) until both front-ends have answered."""
    responses = []
    for _ in range(tries):
        responses.append(send())
        if len({prefix(r) for r in responses}) == 2:
            return responses
    raise AssertionError(f"one front-end answered all {tries} new connections")


def post(url: str, x: np.ndarray, headers: dict | None = None, **params: object) -> httpx.Response:
    content, base = fp32_request(x, **params)
    return httpx.post(f"{url}{INFER}", content=content, headers={**base, **(headers or {})},
                      timeout=60)  # fmt: skip


def demo(x: np.ndarray) -> torch.Tensor:
    with torch.no_grad():
        return mha_engine.demo_module().eval()(torch.from_numpy(x))


# -- numbers ---------------------------------------------------------------------------------------
def test_tritonclient_binary_and_json_match_pytorch_on_both_frontends(workers: Workers) -> None:
    x = np.random.default_rng(0).standard_normal((3, 20, 512)).astype(np.float32)
    expected = demo(x)
    for binary in (True, False):
        for _ in range(3):  # a new client (connection) each: either front-end
            client = triton.InferenceServerClient(workers.server.address)
            item = triton.InferInput("input", list(x.shape), "FP32")
            item.set_data_from_numpy(x, binary_data=binary)
            wanted = [triton.InferRequestedOutput("output", binary_data=binary)]
            # a copy: tritonclient writes Inference-Header-Content-Length into the dict given
            result = client.infer("mha", [item], outputs=wanted, headers=dict(AUTH))
            got = result.as_numpy("output").copy()
            client.close()
            assert got.dtype == np.float32 and got.shape == x.shape
            torch.testing.assert_close(torch.from_numpy(got), expected, **FP32_TOL)
    # and the same from each front-end, told apart by their request ids
    responses = each_frontend(lambda: post(workers.url, x, AUTH))
    for response in responses:
        torch.testing.assert_close(torch.from_numpy(output_of(response)), expected, **FP32_TOL)


def test_grpc_model_infer_on_the_shared_port(workers: Workers) -> None:
    """Both front-ends listen on the one gRPC port (SO_REUSEPORT); tritonclient.grpc gets the
    module's numbers and the API key is checked."""
    listening = listening_inodes(workers.grpc_port)
    assert len(listening) == 2, listening  # one listening socket per front-end
    frontends = [pid for name, pid in worker_pids(workers.server).items() if "frontend" in name]
    assert all(listening & socket_inodes(pid) for pid in frontends), (listening, frontends)
    x = np.random.default_rng(1).standard_normal((2, 7, 512)).astype(np.float32)
    expected = demo(x)
    grpc_auth = {"authorization": f"Bearer {KEY}"}
    for _ in range(4):
        client = tgrpc.InferenceServerClient(f"127.0.0.1:{workers.grpc_port}")
        item = tgrpc.InferInput("input", list(x.shape), "FP32")
        item.set_data_from_numpy(x)
        got = client.infer("mha", [item], headers=grpc_auth).as_numpy("output").copy()
        torch.testing.assert_close(torch.from_numpy(got), expected, **FP32_TOL)
        with pytest.raises(InferenceServerException) as refused:
            client.infer("mha", [item])
        assert refused.value.status() == "StatusCode.UNAUTHENTICATED", refused.value
        client.close()


def test_debug_endpoint_attention_and_heads(workers: Workers) -> None:
    x = np.random.default_rng(2).standard_normal((2, 6, E)).astype(np.float32)
    header = {
        "inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32",
                    "data": x.ravel().tolist()}],
        "parameters": {"average_attn_weights": False},
    }  # fmt: skip
    with torch.no_grad():
        want_out, want_w = workers.attn(*(torch.from_numpy(x),) * 3, average_attn_weights=False)
    for _ in range(2):
        response = httpx.post(f"{workers.url}/v2/models/attn/attention", json=header,
                              headers=AUTH, timeout=60)  # fmt: skip
        assert response.status_code == 200, response.text
        got = {o["name"]: np.asarray(o["data"], np.float32).reshape(o["shape"])
               for o in response.json()["outputs"]}  # fmt: skip
        torch.testing.assert_close(torch.from_numpy(got["output"]), want_out, **FP32_TOL)
        weights = torch.from_numpy(got["attention_weights"])
        torch.testing.assert_close(weights, want_w, **FP32_TOL)
    heads = httpx.get(f"{workers.url}/v2/models/attn/heads", headers=AUTH, timeout=60)
    assert heads.status_code == 200, heads.text
    assert heads.json()["architecture"] == "multihead_attention"
    assert len(heads.json()["layers"]) == 1
    png = httpx.get(f"{workers.url}/v2/models/attn/heads?format=png", headers=AUTH, timeout=60)
    assert png.status_code == 200 and png.content[:8] == b"\x89PNG\r\n\x1a\n"


def test_embeddings_match_sentence_transformers_recipe(workers: Workers) -> None:
    """/v1/embeddings through the unmodified openai client: tokenized on a front-end, computed
    by the engine, equal to BertModel + mean pooling + L2 normalisation."""
    if workers.minilm is None:
        from tests.service.test_embeddings import minilm_dir

        minilm_dir()  # skips, or fails under CI
    openai = pytest.importorskip("openai")
    transformers = pytest.importorskip("transformers")
    from tests.service.test_embeddings import CARD_SENTENCES, MORE_SENTENCES, cosine

    texts = CARD_SENTENCES + MORE_SENTENCES
    model = transformers.BertModel.from_pretrained(str(workers.minilm), add_pooling_layer=False)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(workers.minilm))
    batch = tokenizer(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.no_grad():
        hidden = model.eval()(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    want = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=1).numpy()
    for _ in range(3):
        client = openai.OpenAI(base_url=f"{workers.url}/v1", api_key=KEY, max_retries=0,
                               timeout=60)  # fmt: skip
        result = client.embeddings.create(model=MINILM, input=texts)
        client.close()
        got = np.asarray([d.embedding for d in result.data], np.float32)
        assert got.shape == (len(texts), 384)
        assert cosine(got, want).min() >= 0.99999
        assert result.usage.prompt_tokens == int(batch["attention_mask"].sum())


# -- the HTTP surface ------------------------------------------------------------------------------
def test_api_key_guards_every_front_end_but_health_and_metrics(workers: Workers) -> None:
    x = np.ones((1, 2, 512), np.float32)
    for _ in range(3):
        assert post(workers.url, x).status_code == 401
        assert post(workers.url, x, {"Authorization": "Bearer nope"}).status_code == 403
        assert httpx.get(f"{workers.url}/v2/models/mha").status_code == 401
        assert httpx.get(f"{workers.url}/v2/models/attn/heads").status_code == 401
        embeddings = httpx.post(f"{workers.url}/v1/embeddings", json={"input": "a"})
        assert embeddings.status_code == 401
        for path in ("/v2/health/live", "/v2/health/ready", "/metrics"):
            assert httpx.get(f"{workers.url}{path}").status_code == 200, path
    responses = each_frontend(lambda: post(workers.url, x))
    assert {r.status_code for r in responses} == {401}
    assert all("missing 'Authorization: Bearer" in r.json()["error"] for r in responses)


def test_log_settings_read_on_each_front_end_and_refuse_updates(workers: Workers) -> None:
    """Each front-end has its own logging: a change through one would not reach the other."""
    url = f"{workers.url}/v2/logging"
    refused = each_frontend(lambda: httpx.post(url, json={"log_info": False}, headers=AUTH))
    assert {r.status_code for r in refused} == {400}
    assert all("--workers > 1" in r.json()["error"] for r in refused)
    assert httpx.get(url, headers=AUTH).json()["log_info"] is True
    client = tgrpc.InferenceServerClient(f"127.0.0.1:{workers.grpc_port}")
    settings = client.get_log_settings(headers={"authorization": f"Bearer {KEY}"}, as_json=True)
    settings = settings["settings"]
    assert settings["log_info"] == {"bool_param": True}
    assert httpx.get(f"{workers.url}/health").status_code == 200  # open, as /v2/health/*


def test_request_ids_echoed_and_generated_unique_across_frontends(workers: Workers) -> None:
    responses = each_frontend(lambda: httpx.get(f"{workers.url}/v2/models/mha", headers=AUTH))
    ids = [r.headers["x-request-id"] for r in responses]
    assert len(set(ids)) == len(ids)
    assert len({prefix(r) for r in responses}) == 2
    for i in range(6):
        given = f"client-chosen.id:{i}"
        response = httpx.get(f"{workers.url}/v2/models/mha",
                             headers={**AUTH, "X-Request-ID": given})  # fmt: skip
        assert response.headers["x-request-id"] == given
    content, headers = fp32_request(np.ones((1, 2, 512), np.float32))
    header_length = int(headers["Inference-Header-Content-Length"])
    body = json.loads(content[:header_length])
    body["id"] = "oip-id-7"
    head = json.dumps(body).encode()
    headers["Inference-Header-Content-Length"] = str(len(head))
    response = httpx.post(f"{workers.url}{INFER}", content=head + content[header_length:],
                          headers={**headers, **AUTH})  # fmt: skip
    length = int(response.headers["Inference-Header-Content-Length"])
    assert json.loads(response.content[:length])["id"] == "oip-id-7"


def test_triton_stats_count_requests_from_both_frontends(workers: Workers) -> None:
    def stats() -> dict:
        response = httpx.get(f"{workers.url}/v2/models/mha/stats", headers=AUTH, timeout=30)
        return response.json()["model_stats"][0]

    before = stats()
    x = np.random.default_rng(3).standard_normal((2, 5, 512)).astype(np.float32)
    responses = each_frontend(lambda: post(workers.url, x, AUTH))
    assert all(r.status_code == 200 for r in responses)
    for _ in range(4):  # every front-end reads the same engine-held figures
        after = stats()
        n = len(responses)
        success = after["inference_stats"]["success"]["count"]
        assert success - before["inference_stats"]["success"]["count"] == n
        assert after["inference_count"] - before["inference_count"] == 2 * n


def test_deadline_passed_in_the_engine_queue_is_504_and_never_computed(workers: Workers) -> None:
    def computed() -> int:
        response = httpx.get(f"{workers.url}/v2/models/mha/stats", headers=AUTH, timeout=30)
        return response.json()["model_stats"][0]["inference_count"]

    before = computed()
    x = np.ones((1, 4, 512), np.float32)
    responses = each_frontend(lambda: post(workers.url, x, AUTH, timeout=1))  # 1 µs
    for response in responses:
        assert response.status_code == 504, response.text
        assert "timed out" in response.json()["error"]
    assert computed() == before
    assert post(workers.url, x, AUTH).status_code == 200


def test_client_leaving_mid_body_is_499_at_info(workers: Workers) -> None:
    server = workers.server
    head = (
        f"POST {INFER} HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n"
        f"Authorization: Bearer {KEY}\r\nInference-Header-Content-Length: 100\r\n\r\n"
    )
    before = server.log().count(f"INFO service.access: POST {INFER} 499")
    for _ in range(4):
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(head.encode() + bytes(1000))
            time.sleep(0.1)  # the front-end waits for the rest of the body; leave
    deadline = time.monotonic() + 10
    while server.log().count(f"INFO service.access: POST {INFER} 499") < before + 4:
        assert time.monotonic() < deadline, server.log()[-3000:]
        time.sleep(0.05)
    log = server.log()
    assert log.count(f"INFO service.access: POST {INFER} 499") == before + 4
    assert "Traceback" not in log and f"{INFER} 500" not in log, log[-3000:]


def test_readiness_is_the_engines(workers: Workers) -> None:
    """Both front-ends are ready (connected to the warmed engine) and so is every model."""
    responses = each_frontend(lambda: httpx.get(f"{workers.url}/v2/health/ready"))
    assert {r.status_code for r in responses} == {200}
    for model in ("mha", "attn"):
        ready = httpx.get(f"{workers.url}/v2/models/{model}/ready", headers=AUTH)
        assert ready.status_code == 200, (model, ready.text)
    pids = worker_pids(workers.server)
    assert sorted(pids) == ["mha-engine", "mha-frontend-0", "mha-frontend-1"], pids


def test_metrics_show_the_whole_server(workers: Workers) -> None:
    """Whichever front-end is scraped, request counters are summed over the front-ends and the
    batch counters are the engine's."""
    server = workers.server
    labels = {"model": "attn", "endpoint": "infer", "status": "200"}

    def requests_total() -> float:
        return scrape.value(server.metrics(), "mha_requests_total", default=0.0, **labels)

    x = np.random.default_rng(4).standard_normal((1, 3, E)).astype(np.float32)
    content, headers = fp32_request(x)
    headers.update(AUTH)
    scrapes = [requests_total() for _ in range(4)]
    assert len(set(scrapes)) == 1, scrapes
    before = scrapes[0]
    sequences_before = server.metric("mha_sequences_processed_total", model="attn")
    responses = each_frontend(lambda: httpx.post(f"{server.url}/v2/models/attn/infer",
                                                 content=content, headers=headers))  # fmt: skip
    assert all(r.status_code == 200 for r in responses)
    for _ in range(6):  # new connections: both front-ends are scraped
        assert requests_total() - before == len(responses)
        sequences = server.metric("mha_sequences_processed_total", model="attn")
        assert sequences - sequences_before == len(responses)
        assert server.metric("mha_batches_total", model="attn", outcome="ok") >= 1


# -- a 1 MiB slab and a tiny queue -----------------------------------------------------------------
@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # One engine thread: forwards long enough to queue behind on a fast CPU too
    args = ["--worker-slab-bytes", str(1 << 20), "--max-batch-size", "1",
            "--max-queue", "2", "--max-batch-delay-ms", "0", "--threads", "1"]  # fmt: skip
    env = {"MHA_WORKERS": "2"}  # the environment's way to ask for --workers 2
    with run_server(tmp_path_factory.mktemp("small"), *args, env=env) as server:
        wait_all_ready(server)
        yield server


def test_request_larger_than_the_slab_travels_inline(small: Server) -> None:
    assert sorted(worker_pids(small)) == ["mha-engine", "mha-frontend-0", "mha-frontend-1"]
    x = np.random.default_rng(5).standard_normal((1, 1024, 512)).astype(np.float32)  # 2 MiB
    responses = each_frontend(lambda: post(small.url, x))
    for response in responses:
        torch.testing.assert_close(torch.from_numpy(output_of(response)), demo(x), **FP32_TOL)
    # several at once, some in the slab and some inline, all right
    xs = [np.random.default_rng(i).standard_normal((1, t, 512)).astype(np.float32)
          for i, t in enumerate((64, 1024, 200, 700, 16))]  # fmt: skip
    with ThreadPoolExecutor(5) as pool:
        responses = list(pool.map(lambda x: post(small.url, x), xs))
    for x, response in zip(xs, responses, strict=True):
        if response.status_code == 429:  # a two-sequence queue may refuse some
            continue
        torch.testing.assert_close(torch.from_numpy(output_of(response)), demo(x), **FP32_TOL)


def test_full_shared_queue_answers_429_with_retry_after(small: Server) -> None:
    x = np.random.default_rng(6).standard_normal((1, 1024, 512)).astype(np.float32)
    with ThreadPoolExecutor(16) as pool:
        responses = list(pool.map(lambda _: post(small.url, x), range(16)))
    codes = sorted(r.status_code for r in responses)
    assert set(codes) == {200, 429}, codes
    for r in responses:
        if r.status_code == 429:
            assert r.headers["Retry-After"] == "1"
            assert "queue full" in r.json()["error"] and "of 2 sequences" in r.json()["error"]
    assert post(small.url, x[:, :8]).status_code == 200  # and it recovers


def wait_read(server: Server, sock: socket.socket, pids: list[int]) -> None:
    """Until a front-end has read all that was sent on `sock`, and a little more (to decode and
    queue it: 50 ms)."""
    deadline = time.monotonic() + 10
    while not serving_pid(server.port, sock.getsockname()[1], pids):
        assert time.monotonic() < deadline, "the front-ends did not read the request"
        time.sleep(0.01)
    time.sleep(0.05)


def test_client_gone_while_queued_in_the_engine_is_499_and_never_computed(small: Server) -> None:
    """The front-end withdraws the request from the engine's queue when its client leaves."""

    def stats() -> dict:
        return httpx.get(f"{small.url}/v2/models/mha/stats", timeout=30).json()["model_stats"][0]

    before = stats()
    long = np.random.default_rng(7).standard_normal((1, 2048, 512)).astype(np.float32)
    content, headers = fp32_request(np.ones((1, 4, 512), np.float32))
    request = (
        f"POST {INFER} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(content)}\r\n"
        + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        + "\r\n"
    ).encode() + content
    pids = [p for n, p in worker_pids(small).items() if n.startswith("mha-frontend")]
    engine = worker_pids(small)["mha-engine"]
    long_content, long_headers = fp32_request(long)
    blockers = []
    # One runs, one waits (~2 forwards of 2048 tokens, 0.3 s each on a fast CPU with the one
    # engine thread): the victim queues behind them. The first is running once the engine has
    # used 30 ms of CPU since it went out (as in the 504 test below); waiting on the front-ends
    # alone came too late on a fast CPU. Two only: --max-queue 2 holds the second and the victim.
    for i in range(2):
        conn = http.client.HTTPConnection("127.0.0.1", small.port, timeout=60)
        used = sum(proc_cpu(engine))
        conn.request("POST", INFER, body=long_content, headers=long_headers)
        blockers.append(conn)
        if i == 0:
            wait_for(lambda u=used: sum(proc_cpu(engine)) - u >= 0.03, "the engine computes", 10)
        else:
            wait_read(small, conn.sock, pids)
    with socket.create_connection(("127.0.0.1", small.port)) as sock:
        sock.sendall(request)
        wait_read(small, sock, pids)  # queued behind the long ones; leave
    for conn in blockers:
        response = conn.getresponse()
        assert response.status == 200, response.read()
        conn.close()
    deadline = time.monotonic() + 10
    while stats()["inference_stats"]["fail"]["count"] == before["inference_stats"]["fail"]["count"]:
        assert time.monotonic() < deadline, small.log()[-3000:]
        time.sleep(0.05)
    after = stats()
    assert after["inference_count"] - before["inference_count"] == 2  # the two long ones only
    assert (
        after["inference_stats"]["fail"]["count"] - before["inference_stats"]["fail"]["count"] == 1
    )
    assert small.log().count(f"INFO service.access: POST {INFER} 499") == 1, small.log()[-3000:]


def test_deadline_while_queued_behind_a_forward_is_504_withdrawn(small: Server) -> None:
    """The front-end's timer fires first: it takes the request back out of the engine's queue
    (504 naming the request's own timeout), and the engine never computes it."""

    def computed() -> int:
        response = httpx.get(f"{small.url}/v2/models/mha/stats", timeout=30)
        return response.json()["model_stats"][0]["inference_count"]

    before = computed()
    long = np.random.default_rng(8).standard_normal((1, 2048, 512)).astype(np.float32)
    content, headers = fp32_request(long)
    # The small request must arrive while the blocker runs: the engine process has used 30 ms
    # of CPU since the blocker went out (its forward is ~0.3 CPU-s, its 4 MiB read ~1 ms).
    # Waiting for the front-end to read it and then 50 ms was too late on a fast CPU (the
    # forward had nearly ended). If the small one still runs first (200), the round is
    # repeated, at most three times, and counted.
    engine = worker_pids(small)["mha-engine"]
    expected = 0
    for _ in range(3):
        blocker = http.client.HTTPConnection("127.0.0.1", small.port, timeout=60)
        used = sum(proc_cpu(engine))
        blocker.request("POST", INFER, body=content, headers=headers)
        wait_for(lambda u=used: sum(proc_cpu(engine)) - u >= 0.03, "the engine computes", 10)
        response = post(small.url, np.ones((1, 4, 512), np.float32), timeout=20_000)  # 20 ms
        assert blocker.getresponse().status == 200
        blocker.close()
        expected += 1 if response.status_code == 504 else 2  # the blocker (and the small one)
        if response.status_code != 200:
            break
    assert response.status_code == 504, response.text
    assert response.json()["error"] == "request timed out after 0.020 s in the queue"
    assert computed() - before == expected  # the timed-out request never ran


def test_system_shared_memory_is_not_offered_with_several_front_ends(small: Server) -> None:
    """Regions belong to a process: with --workers 2 they would be per front-end, so the
    extension is not listed and registering says why (400), on every front-end."""
    client = triton.InferenceServerClient(small.address)
    assert "system_shared_memory" not in client.get_server_metadata()["extensions"]
    for _ in range(4):  # new connections: the kernel spreads them over the front-ends
        fresh = triton.InferenceServerClient(small.address)
        with pytest.raises(InferenceServerException, match="needs --workers 1") as info:
            fresh.register_system_shared_memory("r", "/mha-anything", 64)
        assert info.value.status() == "400"
