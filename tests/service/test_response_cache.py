"""The response cache (--response-cache-bytes): identical requests answered without running the
model, with the very bytes a computation gives (batch invariance makes that exact), counted in
Triton's statistics and /metrics, bounded, per model, and never outliving the model copy that
made an output. The real app in process; the unit tests pin the cache's own rules."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import queue
import re
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
import tritonclient.utils.shared_memory as shm
from torch import nn

import mha_engine
from service.oip.inputs import Payload
from service.runtime.response_cache import ENTRY_OVERHEAD, ResponseCache, payload_key, text_key
from service.text.tokenizer import Encoded
from tests import text_models as tm
from tests.inprocess import asgi_client
from tests.service.test_grpc import attention, expected, rng_input, serving
from tests.support import FP32_TOL, binary_output, binary_request

E = 512  # the demo model's embed_dim
INFER = "/v2/models/mha/infer"
SEQUENCES = "mha_sequences_processed_total"
ONE = E * 4 * 4 + ENTRY_OVERHEAD  # the cache's size of one (1, 4, 512) FP32 output


def in_loop(test):
    """Run an async test in a fresh event loop (the suite has no asyncio plugin)."""

    @functools.wraps(test)
    def run(*args: object, **kwargs: object) -> None:
        asyncio.run(test(*args, **kwargs))

    return run


def _query(seed: int, shape: tuple[int, ...] = (1, 4, E)) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _binary(x: np.ndarray, **parameters: object) -> tuple[bytes, dict[str, str]]:
    header = {
        "inputs": [
            {"name": "input", "datatype": "FP32", "shape": list(x.shape),
             "parameters": {"binary_data_size": x.nbytes}},
        ],
        "outputs": [{"name": "output", "parameters": {"binary_data": True}}],
        "parameters": parameters,
    }  # fmt: skip
    if not parameters:
        del header["parameters"]
    return binary_request(header, x.tobytes())


async def _infer(client: httpx.AsyncClient, x: np.ndarray, **parameters: object) -> np.ndarray:
    body, headers = _binary(x, **parameters)
    response = await client.post(INFER, content=body, headers=headers)
    assert response.status_code == 200, response.text
    return binary_output(response.content, response.headers)


def _metric(text: str, name: str, **labels: str) -> float:
    """The value of series `name` whose labels include `labels` (0 when absent)."""
    total = 0.0
    for line in text.splitlines():
        match = re.match(rf"{name}(\{{(.*)\}})? (\S+)$", line)
        if match and all(f'{k}="{v}"' in (match.group(2) or "") for k, v in labels.items()):
            total += float(match.group(3))
    return total


async def _lookups(client: httpx.AsyncClient, model: str = "mha") -> tuple[float, float]:
    text = (await client.get("/metrics")).text
    name = "mha_response_cache_lookups_total"
    return _metric(text, name, model=model, result="hit"), _metric(
        text, name, model=model, result="miss"
    )


async def _stats(client: httpx.AsyncClient, model: str = "mha") -> dict:
    response = await client.get(f"/v2/models/{model}/stats")
    return response.json()["model_stats"][0]


# -- OIP inference -----------------------------------------------------------------------------
@in_loop
async def test_a_repeated_request_is_answered_from_the_cache_with_the_computed_bytes() -> None:
    x = _query(1)
    async with asgi_client(response_cache_bytes=1 << 20, max_batch_delay_ms=0) as client:
        first = await _infer(client, x)
        second = await _infer(client, x)
        # the same tensor as JSON: the same validated inputs, so the same entry
        json_body = {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 4, E],
                                 "data": x.ravel().tolist()}]}  # fmt: skip
        as_json = (await client.post(INFER, json=json_body)).json()["outputs"][0]
        assert await _lookups(client) == (2, 1)
        stats = await _stats(client)
    async with asgi_client(max_batch_delay_ms=0) as plain:  # no cache: computed each time
        computed = await _infer(plain, x)
        assert await _lookups(plain) == (0, 0)
    assert np.array_equal(first, computed) and np.array_equal(second, computed)
    assert np.array_equal(np.asarray(as_json["data"], np.float32).reshape(1, 4, E), computed)
    inference = stats["inference_stats"]
    assert inference["success"]["count"] == 3
    assert inference["cache_hit"]["count"] == 2 and inference["cache_hit"]["ns"] > 0
    assert inference["cache_miss"]["count"] == 1 and inference["cache_miss"]["ns"] > 0
    # as Triton: hits count in queue, not in compute_*; one forward ran
    assert inference["queue"]["count"] == 3
    assert inference["compute_infer"]["count"] == 1
    assert stats["execution_count"] == 1 and stats["inference_count"] == 1


@in_loop
async def test_a_cached_answer_equals_one_computed_beside_batch_mates() -> None:
    """Batch invariance is what makes the cache exact: an output computed in a batch of eight
    requests of other lengths is the one the request gets alone, bit for bit."""
    x = _query(2)
    others = [_query(10 + i, (1, 3 + i, E)) for i in range(7)]
    settings = dict(max_batch_delay_ms=200, batch_delay_policy="fixed")  # all eight in one
    async with asgi_client(response_cache_bytes=1 << 22, **settings) as client:
        batched = await asyncio.gather(*(_infer(client, q) for q in [x, *others]))
        sizes = [b["batch_size"] for b in (await _stats(client))["batch_stats"]]
        cached = await _infer(client, x)
        assert await _lookups(client) == (1, 8)
    async with asgi_client(max_batch_delay_ms=0) as plain:
        alone = await _infer(plain, x)
    assert 1 not in sizes, sizes  # no request ran alone: x had batch-mates
    assert np.array_equal(batched[0], alone) and np.array_equal(cached, alone)


@in_loop
async def test_what_changes_the_output_changes_the_key() -> None:
    x = _query(3)
    masked = {"input": x, "mask": np.array([[False, False, True, True]])}
    async with asgi_client(response_cache_bytes=1 << 22, max_batch_delay_ms=0) as client:
        base = await _infer(client, x)
        causal = await _infer(client, x, is_causal=True)
        y = x.copy()
        y[0, 3, 7] += 1e-3  # one element
        other = await _infer(client, y)
        header = {
            "inputs": [
                {"name": "input", "datatype": "FP32", "shape": [1, 4, E],
                 "parameters": {"binary_data_size": x.nbytes}},
                {"name": "key_padding_mask", "datatype": "BOOL", "shape": [1, 4],
                 "parameters": {"binary_data_size": 4}},
            ],
            "outputs": [{"name": "output", "parameters": {"binary_data": True}}],
        }  # fmt: skip
        body, headers = binary_request(header, x.tobytes(), masked["mask"].tobytes())
        response = await client.post(INFER, content=body, headers=headers)
        with_mask = binary_output(response.content, response.headers)
        two = await _infer(client, x.reshape(2, 2, E))  # the same bytes as two sequences
        assert await _lookups(client) == (0, 5)
    assert not np.array_equal(base, causal)
    assert not np.array_equal(base, other)
    assert not np.array_equal(base[:, :2], with_mask[:, :2])
    assert not np.array_equal(base.reshape(2, 2, E), two)


@in_loop
async def test_a_hit_is_checked_as_a_computed_request_is() -> None:
    x = _query(9)
    async with asgi_client(response_cache_bytes=1 << 20, max_batch_delay_ms=0) as client:
        await _infer(client, x)
        body, headers = _binary(x, timeout=-5)
        response = await client.post(INFER, content=body, headers=headers)
        assert response.status_code == 400, response.text
        assert "timeout" in response.json()["error"]
        assert np.array_equal(await _infer(client, x, timeout=10_000_000), await _infer(client, x))


@in_loop
async def test_the_cache_is_bounded_and_evicts_the_least_recently_used() -> None:
    xs = [_query(20 + i) for i in range(4)]
    async with asgi_client(response_cache_bytes=3 * ONE, max_batch_delay_ms=0) as client:
        for x in xs[:3]:
            await _infer(client, x)
        await _infer(client, xs[0])  # a hit: xs[0] is now the most recently used
        await _infer(client, xs[3])  # evicts xs[1], the least recently used
        await _infer(client, xs[0])  # still held
        await _infer(client, xs[1])  # evicted: computed again
        text = (await client.get("/metrics")).text
        assert await _lookups(client) == (2, 5)
    assert _metric(text, "mha_response_cache_entries") == 3
    assert _metric(text, "mha_response_cache_bytes") == 3 * ONE
    assert _metric(text, "mha_response_cache_capacity_bytes") == 3 * ONE
    assert _metric(text, "mha_response_cache_evictions_total") == 2


@in_loop
async def test_off_by_default_and_the_model_configuration_says_so() -> None:
    x = _query(4)
    async with asgi_client(max_batch_delay_ms=0) as client:
        await _infer(client, x)
        await _infer(client, x)
        config = (await client.get("/v2/models/mha/config")).json()
        stats = await _stats(client)
        assert await _lookups(client) == (0, 0)
    assert config["response_cache"] == {"enable": False}
    assert stats["execution_count"] == 2
    assert stats["inference_stats"]["cache_hit"]["count"] == 0


# -- per model: the settings file, a load's config, reloads ----------------------------------
def _repository(root: Path, settings: dict[str, dict]) -> Path:
    torch.manual_seed(0)
    for name, own in settings.items():
        module = nn.MultiheadAttention(64, 4, batch_first=True).eval()
        mha_engine.save_model(module, root / name / "1")
        if own:
            (root / name / "mha-serve.json").write_text(json.dumps(own))
    return root


async def _infer_model(client: httpx.AsyncClient, model: str, x: np.ndarray) -> np.ndarray:
    body, headers = _binary(x)
    response = await client.post(f"/v2/models/{model}/infer", content=body, headers=headers)
    assert response.status_code == 200, response.text
    return binary_output(response.content, response.headers)


@in_loop
async def test_a_model_may_turn_the_cache_off_and_a_load_config_on_again(tmp_path: Path) -> None:
    repo = _repository(tmp_path, {"on": {}, "off": {"response_cache": False}})
    x = _query(5, (1, 4, 64))
    settings = dict(model_repository=repo, model_control_mode="explicit", max_batch_delay_ms=0)
    async with asgi_client(response_cache_bytes=1 << 20, **settings) as client:
        for model in ("on", "off", "on", "off"):
            await _infer_model(client, model, x)
        assert await _lookups(client, "on") == (1, 1)
        assert await _lookups(client, "off") == (0, 0)
        configs = [(await client.get(f"/v2/models/{m}/config")).json() for m in ("on", "off")]
        assert [c["response_cache"] for c in configs] == [{"enable": True}, {"enable": False}]

        # Triton's form in a load's config, over the settings file
        config = json.dumps({"response_cache": {"enable": True}})
        load = await client.post(
            "/v2/repository/models/off/load", json={"parameters": {"config": config}}
        )
        assert load.status_code == 200, load.text
        assert (await client.get("/v2/models/off/config")).json()["response_cache"] == {
            "enable": True
        }
        await _infer_model(client, "off", x)
        await _infer_model(client, "off", x)
        assert await _lookups(client, "off") == (1, 1)

        # Triton's empty form: enable defaults to false
        empty = json.dumps({"response_cache": {}})
        load = await client.post(
            "/v2/repository/models/off/load", json={"parameters": {"config": empty}}
        )
        assert load.status_code == 200, load.text
        assert (await client.get("/v2/models/off/config")).json()["response_cache"] == {
            "enable": False
        }

        for bad, says in (
            ({"response_cache": {"enable": "yes"}}, "response_cache.enable"),
            ({"response_cache": {"enabled": True}}, "response_cache.enabled"),
            ({"response_cache": [True]}, "response_cache"),
        ):
            response = await client.post(
                "/v2/repository/models/off/load",
                json={"parameters": {"config": json.dumps(bad)}},
            )
            assert response.status_code == 400, (bad, response.text)
            assert says in response.json()["error"], response.text


@in_loop
async def test_a_reload_never_answers_with_the_old_copys_outputs(tmp_path: Path) -> None:
    repo = _repository(tmp_path, {"m": {}, "other": {}})
    x = _query(6, (1, 4, 64))
    settings = dict(model_repository=repo, model_control_mode="explicit", max_batch_delay_ms=0)
    async with asgi_client(response_cache_bytes=1 << 20, **settings) as client:
        before = await _infer_model(client, "m", x)
        await _infer_model(client, "other", x)
        torch.manual_seed(1)  # new weights on disk, the same name and version
        mha_engine.save_model(
            nn.MultiheadAttention(64, 4, batch_first=True).eval(), repo / "m" / "1"
        )
        assert (await client.post("/v2/repository/models/m/load")).status_code == 200
        after = await _infer_model(client, "m", x)
        again = await _infer_model(client, "m", x)
        text = (await client.get("/metrics")).text
        assert await _lookups(client, "m") == (1, 2)
        # the unloaded copy's entry is gone; the other model's and the new copy's remain
        assert _metric(text, "mha_response_cache_entries") == 2
        unload = await client.post("/v2/repository/models/m/unload")
        assert unload.status_code == 200
        text = (await client.get("/metrics")).text
        assert _metric(text, "mha_response_cache_entries") == 1
    assert not np.allclose(before, after)
    assert np.array_equal(after, again)


# -- text routes: one entry per input ----------------------------------------------------------
@pytest.fixture(scope="module")
def embedder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    _, path = tm.sentence_transformer(tmp_path_factory.mktemp("emb") / "emb")
    return path


async def _embed(client: httpx.AsyncClient, texts: list[str]) -> list[list[float]]:
    response = await client.post("/v1/embeddings", json={"input": texts, "model": "emb"})
    assert response.status_code == 200, response.text
    return [item["embedding"] for item in response.json()["data"]]


@in_loop
async def test_text_inputs_are_cached_one_by_one(embedder: Path) -> None:
    a, b, c = "the cat sat on the mat", "what is deep learning?", "hello world"
    settings = dict(model_dir=[embedder], max_batch_delay_ms=0)
    async with asgi_client(response_cache_bytes=1 << 20, **settings) as client:
        warm_up = _metric((await client.get("/metrics")).text, SEQUENCES, model="emb")
        first = await _embed(client, [a, b, a])  # the repeat is computed once
        assert await _lookups(client, "emb") == (1, 2)
        second = await _embed(client, [c, a])
        assert await _lookups(client, "emb") == (2, 3)
        executions = (await client.get("/metrics")).text
        # TEI's /embed without normalising runs another runner: its own entries
        raw = await client.post("/embed", json={"inputs": [a], "normalize": False})
        assert raw.status_code == 200, raw.text
        assert await _lookups(client, "emb") == (2, 4)
    async with asgi_client(**settings) as plain:
        computed = await _embed(plain, [a, b, c])
        raw_computed = await plain.post("/embed", json={"inputs": [a], "normalize": False})
    assert first == [computed[0], computed[1], computed[0]]
    assert second == [computed[2], computed[0]]
    assert raw.json() == raw_computed.json()
    assert _metric(executions, SEQUENCES, model="emb") - warm_up == 3


@in_loop
async def test_token_states_and_similarity_are_cached_and_equal_computed_ones(
    embedder: Path,
) -> None:
    a, b = "the cat sat on the mat", "a dog sat on the mat"
    similarity = {"inputs": {"source_sentence": a, "sentences": [b, a]}}
    settings = dict(model_dir=[embedder], max_batch_delay_ms=0)

    async def run(client: httpx.AsyncClient) -> list:
        answers = []
        for path, body in (("/embed_all", {"inputs": [a, b]}), ("/embed_all", {"inputs": [b]}),
                           ("/similarity", similarity)):  # fmt: skip
            response = await client.post(path, json=body)
            assert response.status_code == 200, response.text
            answers.append(response.json())
        return answers

    async with asgi_client(response_cache_bytes=1 << 20, **settings) as client:
        cached = await run(client)
        # /embed_all: a, b computed, then b a hit; /similarity's runner is /embed's (raw
        # vectors): a computed once for both of its places, b computed
        assert await _lookups(client, "emb") == (2, 4)
    async with asgi_client(**settings) as plain:
        assert cached == await run(plain)


@in_loop
async def test_every_input_a_hit_runs_nothing(embedder: Path) -> None:
    texts = ["good movie", "bad weather"]
    settings = dict(model_dir=[embedder], max_batch_delay_ms=0)
    async with asgi_client(response_cache_bytes=1 << 20, **settings) as client:
        once = await _embed(client, texts)
        before = _metric((await client.get("/metrics")).text, "mha_batches_total")
        twice = await _embed(client, texts)
        after = _metric((await client.get("/metrics")).text, "mha_batches_total")
    assert once == twice
    assert after == before


@pytest.fixture(scope="module")
def rankers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("rank")
    return {
        "rr": tm.classifier("bert", root / "rr", {0: "score"})[1],
        "cls": tm.classifier("bert", root / "cls", seed=1)[1],
    }


@in_loop
async def test_pairs_are_cached_with_their_token_types(rankers: dict[str, Path]) -> None:
    """A reranker's (query, text) pairs and a classifier's pairs: token types are in the key, so
    a pair never meets the entry of the same words as one text."""
    query, texts = "what is deep learning?", ["deep learning is a model", "the cat sat"]
    settings = dict(model_dir=[rankers["rr"], rankers["cls"]], max_batch_delay_ms=0)

    async def run(client: httpx.AsyncClient) -> list:
        return [
            (await client.post("/models/rr/rerank", json={"query": query, "texts": texts})).json(),
            (await client.post("/models/rr/rerank", json={"query": query, "texts": texts})).json(),
            (await client.post("/models/cls/predict", json={"inputs": [query, texts[0]]})).json(),
            (await client.post("/models/cls/predict", json={"inputs": query + texts[0]})).json(),
            (await client.post("/models/cls/predict", json={"inputs": [query, texts[0]]})).json(),
        ]

    async with asgi_client(response_cache_bytes=1 << 20, **settings) as client:
        cached = await run(client)
        assert await _lookups(client, "rr") == (2, 2)
        assert await _lookups(client, "cls") == (1, 2)  # one pair, one text of the same words
    async with asgi_client(**settings) as plain:
        computed = await run(plain)
    assert cached == computed
    assert cached[2] != cached[3]


# -- the cache's own rules ---------------------------------------------------------------------
def test_put_keeps_a_read_only_copy_and_evicts_in_use_order() -> None:
    cache = ResponseCache(2 * (64 + ENTRY_OVERHEAD))
    batch = np.arange(32, dtype=np.float32).reshape(2, 16)
    kept = cache.put((1, b"a"), batch[0])
    assert not np.shares_memory(kept, batch) and not kept.flags.writeable
    with pytest.raises(ValueError):
        kept[0] = 5.0
    cache.put((1, b"b"), batch[1])
    assert cache.get((1, b"a")) is kept  # now the most recently used
    cache.put((1, b"c"), batch[1])
    assert cache.get((1, b"b")) is None and cache.get((1, b"a")) is kept
    assert len(cache) == 2 and cache.bytes == 2 * (64 + ENTRY_OVERHEAD)


def test_an_output_larger_than_the_cache_is_answered_but_not_kept() -> None:
    cache = ResponseCache(1000)
    big = np.zeros(1000, np.float32)
    assert cache.put((1, b"big"), big) is big
    assert len(cache) == 0 and cache.bytes == 0


def test_drop_forgets_a_copy_and_refuses_its_late_outputs() -> None:
    cache = ResponseCache(1 << 16)
    row = np.ones(4, np.float32)
    cache.put((1, b"a"), row)
    cache.put((2, b"a"), row)
    assert cache.drop({1}) == 1
    cache.put((1, b"b"), row)  # a request of the unloaded copy finishing late
    assert cache.get((1, b"a")) is None and cache.get((1, b"b")) is None
    assert cache.get((2, b"a")) is not None and len(cache) == 1


def test_payload_keys_tell_apart_everything_that_decides_the_output() -> None:
    q = np.arange(8 * 4, dtype=np.float32).reshape(8, 4)
    base = Payload(q, [4, 4])
    same = Payload(q.copy(), [4, 4])
    variants = [
        Payload(q, [8]),  # the same bytes, other lengths
        Payload(q, [4, 4], is_causal=True),
        Payload(q, [4, 4], key_padding_mask=np.zeros(8, bool)),
        Payload(q, [4, 4], datatype="FP16"),
        Payload(q, [4, 4], batched=False),
        Payload(q.reshape(4, 8), [2, 2]),  # the same bytes, another width
        Payload(q, [4, 4], key=q, value=q),
        Payload(q, [4, 4], key=q, value=q, key_lengths=[2, 6]),
        Payload(q, [4, 4], tgt_key_padding_mask=np.zeros(8, bool)),
        Payload(q, [4, 4], key=q, src_key_padding_mask=np.zeros(8, bool)),
        Payload(q, [4, 4], token_types=np.zeros(8, np.int64)),
    ]
    assert payload_key(1, base) == payload_key(1, same)
    assert payload_key(1, base) != payload_key(2, base)  # another model copy
    keys = {payload_key(1, p) for p in [base, *variants]}
    assert len(keys) == 1 + len(variants)


def test_text_keys_tell_apart_runners_ids_and_token_types() -> None:
    ids = np.array([2, 10, 11, 3], np.int64)
    one = Encoded(ids, False)
    keys = {
        text_key(1, "embed_runner", one),
        text_key(1, "raw_embed_runner", one),
        text_key(1, "embed_runner", Encoded(ids[:3], False)),
        text_key(1, "embed_runner", Encoded(ids, False, np.zeros(4, np.int64))),
        text_key(1, "embed_runner", Encoded(ids, False, np.array([0, 0, 1, 1], np.int64))),
    }
    assert len(keys) == 5
    again = Encoded(ids.copy(), True)  # `truncated` is no part of the output
    assert text_key(1, "embed_runner", again) == text_key(1, "embed_runner", one)


# -- real servers: gRPC and shared memory with the unmodified tritonclient; --workers ---------
def test_grpc_hits_into_shared_memory_and_statistics_over_grpc(tmp_path: Path) -> None:
    module = attention(32)
    x = rng_input(7, 2, 5, 32)
    nbytes = x.nbytes
    with serving(tmp_path, module, "--response-cache-bytes", "1000000") as server:
        client = server.client()
        key = f"/mha-test-{os.getpid()}-cache"
        handle = shm.create_shared_memory_region("out", key, nbytes)
        try:
            client.register_system_shared_memory("out", key, nbytes)
            got = []
            for _ in range(2):
                item = tgrpc.InferInput("input", list(x.shape), "FP32")
                item.set_data_from_numpy(x)
                output = tgrpc.InferRequestedOutput("output")
                output.set_shared_memory("out", nbytes)
                shm.set_shared_memory_region(handle, [np.zeros_like(x)])
                client.infer("attn", [item], outputs=[output])
                got.append(shm.get_contents_as_numpy(handle, np.float32, list(x.shape)).copy())
            client.unregister_system_shared_memory()
        finally:
            shm.destroy_shared_memory_region(handle)
        # each request of a stream is looked up as a unary call is: both hits
        answers: queue.Queue = queue.Queue()
        client.start_stream(lambda result, error: answers.put((result, error)))
        for i in range(2):
            item = tgrpc.InferInput("input", list(x.shape), "FP32")
            item.set_data_from_numpy(x)
            client.async_stream_infer("attn", [item], request_id=f"s{i}")
        streamed = [answers.get(timeout=30) for _ in range(2)]
        client.stop_stream()
        stats = client.get_inference_statistics("attn", as_json=True)["model_stats"][0]
        config = client.get_model_config("attn", as_json=True)["config"]
    np.testing.assert_allclose(got[0], expected(module, x).numpy(), **FP32_TOL)
    assert np.array_equal(got[0], got[1])
    for result, error in streamed:
        assert error is None and np.array_equal(result.as_numpy("output"), got[0])
    inference = stats["inference_stats"]
    assert inference["cache_hit"]["count"] == "3" and inference["cache_miss"]["count"] == "1"
    assert config["response_cache"] == {"enable": True}


def test_each_front_end_of_workers_keeps_a_cache(tmp_path: Path) -> None:
    module = attention(32)
    x = rng_input(8, 1, 6, 32)
    args = ("--workers", "2", "--response-cache-bytes", "1000000")
    with serving(tmp_path, module, *args) as server:
        client = thttp.InferenceServerClient(server.http.address)  # one connection: one front-end
        got = []
        for _ in range(3):
            item = thttp.InferInput("input", list(x.shape), "FP32")
            item.set_data_from_numpy(x)
            got.append(client.infer("attn", [item]).as_numpy("output"))
        stats = client.get_inference_statistics("attn")["model_stats"][0]["inference_stats"]
        text = httpx.get(f"{server.http.url}/metrics").text
    np.testing.assert_allclose(got[0], expected(module, x).numpy(), **FP32_TOL)
    assert all(np.array_equal(g, got[0]) for g in got)
    # the statistics live in the engine process: the front-end's hits reach it
    assert stats["cache_hit"]["count"] == 2 and stats["cache_miss"]["count"] == 1
    assert _metric(text, "mha_response_cache_lookups_total", result="hit") == 2
    assert _metric(text, "mha_response_cache_capacity_bytes") == 2 * 1_000_000
