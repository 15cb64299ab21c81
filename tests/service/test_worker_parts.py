"""The pieces `--workers` is built from, on their own: the slab allocator, message framing,
payloads and results crossing as slab regions or inline, and the model view."""

from __future__ import annotations

import asyncio
import os
import pickle
import random
import socket

import numpy as np
import pytest

import mha_engine
from service.__main__ import parse_settings
from service.oip.inputs import Payload
from service.pipeline.errors import InferenceError
from service.runtime.forward import hidden_states
from service.runtime.work import Work
from service.text.tokenizer import Encoded, typed_payload
from service.workers.channel import FrameBuffer, frame, frame_all
from service.workers.engine import Connection
from service.workers.link import EngineLink
from service.workers.messages import Done, Error, Submit
from service.workers.slab import ALIGN, Slab
from service.workers.wire import (
    ModelView,
    payload_from_wire,
    payload_to_wire,
    result_from_wire,
    result_to_wire,
)


def test_slab_allocates_aligned_regions_and_merges_them_back() -> None:
    slab = Slab(64 * 1024)
    rng = random.Random(0)
    held = []
    for _ in range(200):
        if held and rng.random() < 0.45:
            slab.free(*held.pop(rng.randrange(len(held))))
            continue
        nbytes = rng.randrange(1, 3000)
        offset = slab.alloc(nbytes)
        if offset is None:
            continue
        assert offset % ALIGN == 0
        for other, size in held:  # no overlap with any region still held
            assert offset + nbytes <= other or other + size <= offset
        held.append((offset, nbytes))
    # free the rest in random order: the slab is one free block again
    for offset, nbytes in [held[i] for i in rng.sample(range(len(held)), len(held))]:
        slab.free(offset, nbytes)
    assert slab.used == 0
    assert slab.alloc(64 * 1024) == 0
    slab.close()


def test_slab_full_says_none() -> None:
    slab = Slab(4096)
    assert slab.alloc(4096) == 0
    assert slab.alloc(1) is None
    slab.free(0, 4096)
    assert slab.alloc(5000) is None  # larger than the slab: the caller sends it inline
    slab.close()


def test_a_second_mapping_of_the_fd_sees_the_same_memory() -> None:
    """What the engine process does with the fd the front-end sends it."""
    slab = Slab(1 << 20)
    other = Slab(1 << 20, fd=os.dup(slab.fd))
    offset = slab.alloc(4 * 100)
    slab.array(offset, (10, 10), "<f4")[...] = np.arange(100, dtype=np.float32).reshape(10, 10)
    np.testing.assert_array_equal(other.array(offset, (10, 10), "<f4").ravel(), np.arange(100))
    other.array(offset, (10, 10), "<f4")[0, 0] = -1.0
    assert slab.array(offset, (10, 10), "<f4")[0, 0] == -1.0
    other.close()
    slab.close()


@pytest.mark.parametrize("per_frame", [1, 7])
def test_frames_cut_anywhere_come_out_whole(per_frame: int) -> None:
    """One message a frame, or several (a loop turn's, pickled together): the same messages
    come out, in order, wherever the stream is cut."""
    messages = [("submit", i, ("m", "1"), np.arange(i), {"x": "y" * i}) for i in range(30)]
    groups = [messages[i : i + per_frame] for i in range(0, len(messages), per_frame)]
    stream = b"".join(frame(*group) for group in groups)
    rng = random.Random(1)
    buffer, got, pos = FrameBuffer(), [], 0
    while pos < len(stream):
        step = rng.randrange(1, 200)
        got += buffer.feed(stream[pos : pos + step])
        pos += step
    assert len(got) == len(messages)
    for sent, received in zip(messages, got, strict=True):
        assert sent[:3] == received[:3] and sent[4] == received[4]
        np.testing.assert_array_equal(sent[3], received[3])


def test_a_message_that_does_not_pickle_fails_alone() -> None:
    """frame_all: the frame-mates of a message that cannot be pickled still go, in order, and
    the failing one is replaced by what on_failure gives (or left out for None)."""
    failed = []

    def on_failure(message):
        failed.append(message[0])
        return ("error", message[0]) if message[0] == 1 else None

    messages = [(0, "ok"), (1, lambda: None), (2, "ok"), (3, lambda: None), (4, "ok")]
    got = FrameBuffer().feed(frame_all(messages, on_failure))
    assert failed == [1, 3]
    assert got == [(0, "ok"), ("error", 1), (2, "ok"), (4, "ok")]
    assert FrameBuffer().feed(frame_all([(5, "ok")], on_failure)) == [(5, "ok")]
    # a replacement that cannot be pickled either is left out; the rest still go
    both_bad = frame_all([(6, lambda: None), (7, "ok")], lambda m: (m[0], lambda: None))
    assert FrameBuffer().feed(both_bad) == [(7, "ok")]


def test_engine_replies_that_do_not_pickle_fail_their_request_alone() -> None:
    """The engine's writer pickles a batch's replies together; a result that cannot travel
    becomes an Error for its request, and the other replies of its frame arrive as sent."""
    mine, theirs = socket.socketpair()
    conn = Connection(mine, Slab(1 << 16), 0)
    try:
        conn.send(Done(1, ("obj", lambda: None), 0.0, 0.0))  # a result that does not pickle
        conn.send(Done(2, ("obj", "fine"), 0.0, 0.0))
        theirs.settimeout(10)
        buffer, got = FrameBuffer(), []
        while len(got) < 2:
            got += buffer.feed(theirs.recv(1 << 16))
    finally:
        conn.close()
        theirs.close()
    assert isinstance(got[0], Error) and got[0].ident == 1
    assert isinstance(got[0].error, InferenceError)
    assert got[1] == Done(2, ("obj", "fine"), 0.0, 0.0)


@pytest.mark.anyio
async def test_front_end_messages_that_do_not_pickle_fail_their_request_alone() -> None:
    """A front-end's loop turn goes out as one frame; a submit that cannot be pickled fails its
    own request at once, and the turn's other messages still reach the engine."""
    loop = asyncio.get_running_loop()
    mine, theirs = socket.socketpair()
    link = EngineLink("unused", 0, 1 << 16)
    link.transport, _ = await loop.create_unix_connection(lambda: asyncio.Protocol(), sock=mine)
    payload = Payload(np.zeros((2, 4), np.float32), [2])
    bad = Work(payload=payload, runner=hidden_states, deadline=1e9, loop=loop)
    good = Work(payload=payload, runner=hidden_states, deadline=1e9, loop=loop)
    try:
        link.submit(bad, Submit(1, ("m", "1"), lambda: None, 1e9, {}, None), [], None)
        link.submit(good, Submit(2, ("m", "1"), hidden_states, 1e9, {}, None), [], None)
        await asyncio.sleep(0)  # the turn ends: its frame is written
        with pytest.raises(InferenceError):
            await asyncio.wait_for(bad.future, 5)
        theirs.setblocking(False)
        received = FrameBuffer().feed(await loop.sock_recv(theirs, 1 << 16))
    finally:
        link.transport.close()
        theirs.close()
    assert [m.ident for m in received] == [2]
    assert not good.future.done() and list(link.pending) == [2]  # still waiting on its reply


def _payload(rng: np.random.Generator) -> Payload:
    query = rng.standard_normal((12, 8), dtype=np.float32)  # (N, E)
    key = rng.standard_normal((10, 8), dtype=np.float32)  # (M, kdim)
    mask = np.zeros(10, dtype=bool)
    mask[3] = True
    return Payload(query, [5, 7], key, key.copy(), [4, 6], mask, is_causal=False)


@pytest.mark.parametrize("full", [False, True])
def test_payload_crosses_by_slab_or_inline(full: bool) -> None:
    payload = _payload(np.random.default_rng(2))
    size = 1 << 20
    slab = Slab(size)
    if full:
        slab.alloc(size)
    regions: list[tuple[int, int]] = []
    wire = pickle.loads(pickle.dumps(payload_to_wire(payload, slab, regions)))
    if full:
        assert not regions  # nothing fitted: every array travels inline, pickled
    else:
        assert len(regions) == 4 and isinstance(wire["query"], tuple)
    got = payload_from_wire(wire, Slab(size, fd=os.dup(slab.fd)))
    for name in ("query", "key", "value", "key_padding_mask"):
        np.testing.assert_array_equal(getattr(got, name), getattr(payload, name))
    assert (got.lengths, got.key_lengths, got.datatype) == ([5, 7], [4, 6], "FP32")
    for offset, nbytes in regions:
        slab.free(offset, nbytes)
    assert slab.used == (size if full else 0)


def test_text_pair_token_types_cross_as_their_own_field() -> None:
    """A classifier's payload: token ids in `query`, token types beside them (not stacked)."""
    ids = [np.array([101, 7, 102, 9, 102]), np.array([101, 5, 102])]
    types = [np.array([0, 0, 0, 1, 1]), np.array([0, 0, 0])]
    encoded = [Encoded(i, truncated=False, types=t) for i, t in zip(ids, types, strict=True)]
    payload = typed_payload(encoded)
    assert payload.query.shape == payload.token_types.shape == (8,)
    slab = Slab(1 << 16)
    regions: list[tuple[int, int]] = []
    wire = pickle.loads(pickle.dumps(payload_to_wire(payload, slab, regions)))
    got = payload_from_wire(wire, Slab(1 << 16, fd=os.dup(slab.fd)))
    np.testing.assert_array_equal(got.query, np.concatenate(ids))
    np.testing.assert_array_equal(got.token_types, np.concatenate(types))
    assert got.lengths == [5, 3]


def test_results_come_back_through_the_output_region_or_inline() -> None:
    slab = Slab(1 << 16)
    out = (slab.alloc(400), 400)
    result = np.arange(100, dtype=np.float32).reshape(10, 10)
    reply = result_to_wire(slab, out, result)
    assert reply[0] == "shm"
    copy = result_from_wire(slab, out, reply)
    slab.array(out[0], (10, 10), "<f4")[...] = 0  # the region is reused: the copy stays
    np.testing.assert_array_equal(copy, result)
    too_big = np.zeros(200, np.float32)
    assert result_to_wire(slab, out, too_big)[0] == "obj"
    assert result_to_wire(slab, None, [np.ones(3)])[0] == "obj"  # logits lists go inline


def test_model_view_carries_facts_not_weights() -> None:
    model = mha_engine.build_demo_model()
    view = pickle.loads(pickle.dumps(ModelView.of(model)))
    assert (view.embed_dim, view.num_heads, view.num_layers) == (512, 8, 1)
    assert (view.dtype, view.device, view.architecture) == (
        model.dtype,
        model.device,
        model.architecture,
    )
    assert view.text_kind is None
    with pytest.raises(AttributeError, match="engine process"):
        view.forward_packed  # noqa: B018
    assert hidden_states.__module__ == "service.runtime.forward"  # sent by name: a module function


def test_workers_refuse_explicit_model_control(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_settings(["--workers", "2", "--model-control-mode", "explicit"])
    assert exit_info.value.code == 2
    assert "--workers > 1" in capsys.readouterr().err
    assert parse_settings(["--workers", "3"]).workers == 3
