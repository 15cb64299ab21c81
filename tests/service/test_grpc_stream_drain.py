"""gRPC streams a client still has open when the server drains (SIGTERM): each stops being read,
answers what it had read, and ends UNAVAILABLE (which clients retry) at once, rather than
holding the process until the grace runs out and then being cut off by gRPC itself
(UNAVAILABLE "Cancelling all calls", without our message). A real server, with
tritonclient's ModelStreamInfer stream, TEI's EmbedStream and RerankStream and a server
reflection stream open at the signal."""

from __future__ import annotations

import asyncio
import queue
import signal
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
import tritonclient.grpc as tgrpc

import mha_engine
from service.grpc import reflection_pb2, reflection_pb2_grpc
from service.grpc import tei_pb2 as pb
from service.grpc import tei_pb2_grpc as pb_grpc
from service.grpc.calls import STREAM_DRAINED
from tests.service.test_grpc import attention, expected, fp32_input, rng_input
from tests.support import FP32_TOL, free_port, run_server, wait_for

pytest.importorskip("transformers")
from tests import text_models as tm
from tests.service.test_text_routing import mean_pooled

NAME = "attn"
EMBED_DIM = 32
GRACE_S = 30.0  # far longer than the drain takes once the streams end


def queued(server, model: str) -> bool:
    try:
        return server.metric("mha_queue_depth_sequences", model=model) >= 1
    except KeyError:
        return False


def test_open_streams_end_unavailable_at_the_drain_and_the_server_exits(tmp_path: Path) -> None:
    module = attention(EMBED_DIM)
    mha_engine.save_model(module, tmp_path / NAME)
    emb, emb_dir = tm.sentence_transformer(tmp_path / "emb", pooling="mean", normalize=True)
    _, rr_dir = tm.classifier("bert", tmp_path / "rr", {0: "score"}, seed=2)
    port = free_port()
    args = ("--model-dir", str(tmp_path / NAME), "--model-dir", str(emb_dir),
            "--model-dir", str(rr_dir), "--grpc-port", str(port),
            "--max-batch-delay-ms", "2000", "--drain-grace-s", str(GRACE_S))  # fmt: skip
    results: queue.Queue = queue.Queue()
    x = rng_input(1, 1, 4, EMBED_DIM)

    with run_server(tmp_path, *args) as server:
        triton = tgrpc.InferenceServerClient(f"127.0.0.1:{port}")
        triton.start_stream(callback=lambda result, error: results.put((result, error)))

        async def streams() -> tuple[list, float]:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                embed = pb_grpc.EmbedStub(channel).EmbedStream()
                await embed.write(pb.EmbedRequest(inputs="hello world"))
                first = await embed.read()  # answered: the stream goes on, idle
                rerank = pb_grpc.RerankStub(channel).RerankStream()
                await rerank.write(pb.RerankStreamRequest(query="what", text="that"))
                reflect = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo()
                await reflect.write(reflection_pb2.ServerReflectionRequest(list_services=""))
                listed = await reflect.read()
                assert "tei.v1.Embed" in [s.name for s in listed.list_services_response.service]
                # a request of tritonclient's stream waits out the batch delay at the signal
                triton.async_stream_infer(NAME, [fp32_input(x)], request_id="held")
                await asyncio.to_thread(wait_for, lambda: queued(server, NAME), "queued", 30)
                server.process.send_signal(signal.SIGTERM)
                sent = time.monotonic()
                ends = [(await c.code(), await c.details()) for c in (embed, rerank, reflect)]
            return [first, *ends], sent

        (first, *ends), sent = asyncio.run(streams())
        code = server.process.wait(GRACE_S)
        exit_after = time.monotonic() - sent
        triton.stop_stream()
        log = server.log()

    # EmbedStream's answer before the signal, as transformers computes it
    got = np.asarray([list(first.embeddings)], np.float32)
    np.testing.assert_allclose(got, mean_pooled(emb, emb_dir, ["hello world"]), **FP32_TOL)
    assert ends == [(grpc.StatusCode.UNAVAILABLE, STREAM_DRAINED)] * 3, ends
    # tritonclient: the request read before the signal answered, then the stream's end
    result, error = results.get(timeout=10)
    assert error is None, error
    assert result.get_response().id == "held"
    got = torch.from_numpy(result.as_numpy("output").copy())
    torch.testing.assert_close(got, expected(module, x), **FP32_TOL)
    result, error = results.get(timeout=10)
    assert result is None and "UNAVAILABLE" in str(error.status()), error
    assert STREAM_DRAINED in error.message(), error
    assert code in (0, -signal.SIGTERM), log[-3000:]  # uvicorn re-raises the signal it caught
    assert exit_after < 10, (exit_after, log[-3000:])  # not the 30 s grace
    assert "Traceback" not in log, log[-3000:]
