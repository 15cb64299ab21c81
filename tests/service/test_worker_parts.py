"""The pieces `--workers` is built from, on their own: the slab allocator, message framing,
payloads and results crossing as slab regions or inline, and the model view."""

from __future__ import annotations

import os
import pickle
import random

import numpy as np
import pytest

import mha_engine
from service.__main__ import parse_settings
from service.oip.inputs import Payload
from service.runtime.forward import hidden_states
from service.text.tokenizer import Encoded, typed_payload
from service.workers.channel import FrameBuffer, frame
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


def test_frames_cut_anywhere_come_out_whole() -> None:
    messages = [("submit", i, ("m", "1"), np.arange(i), {"x": "y" * i}) for i in range(30)]
    stream = b"".join(frame(m) for m in messages)
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
