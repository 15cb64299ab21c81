"""CUDA-graph buckets on the CPU: the bucket a batch gets, the padded cu_seqlens it replays with,
and the refusals (no CUDA device, layers that cannot replay). The replays themselves run on a GPU
in tests/gpu/test_gpu_engine.py."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch

from mha_engine.checkpoint import model_from_state_dict
from mha_engine.cuda_graphs import (
    CudaGraphs,
    _cu_seqlens,
    bucket,
    bucket_key,
    bucket_slots,
    plain_call,
)
from mha_engine.save import module_config, module_state


@pytest.mark.parametrize(("n", "want"), [(0, 16), (1, 16), (16, 16), (17, 32), (1000, 1024)])
def test_bucket_is_the_next_power_of_two_from_16(n, want):
    assert bucket(n) == want


def test_bucket_key_takes_tokens_and_longest_sequence():
    assert bucket_key([5, 9], 4096, 32) == (16, 16)
    assert bucket_key([300, 20], 4096, 32) == (512, 512)
    assert bucket_key([40] * 20, 4096, 32) == (1024, 64)
    assert bucket_key([5000], 4096, 32) is None  # past the largest bucket: eager
    assert bucket_key([1] * 33, 4096, 32) is None  # past max_sequences
    assert bucket_key([], 4096, 32) is None


def test_padding_rows_form_their_own_sequences_and_slots_stay_empty():
    lens = [3, 7, 1]
    tokens, max_len = bucket_key(lens, 4096, 8)
    slots = bucket_slots(tokens, max_len, 8)
    cu = _cu_seqlens(lens, tokens, max_len, slots)
    assert len(cu) == slots + 1
    assert cu[:4] == [0, 3, 10, 11]  # the real sequences, unchanged
    chunks = [b - a for a, b in pairwise(cu[3:]) if b > a]
    assert sum(chunks) == tokens - 11 and max(chunks) <= max_len  # padding, never longer
    assert cu[-1] == tokens and all(a <= b for a, b in pairwise(cu))


def test_more_sequences_than_slots_is_refused():
    with pytest.raises(ValueError, match="do not fit"):
        _cu_seqlens([1] * 10, 16, 16, 4)


def test_plain_calls_are_the_unmasked_non_causal_ones():
    assert plain_call(None, False) and plain_call(None, [False, False])
    assert not plain_call(None, [False, True]) and not plain_call(None, True)
    assert not plain_call(torch.zeros(3, dtype=torch.bool), False)
    assert plain_call(None, torch.tensor([False])) and not plain_call(None, torch.tensor([True]))


def _model(**kwargs) -> torch.nn.Module:
    module = torch.nn.MultiheadAttention(32, 4, batch_first=True, **kwargs).eval()
    return model_from_state_dict(module_config(module), module_state(module), "cpu", "float32")


def test_graphs_need_a_cuda_device():
    with pytest.raises(ValueError, match="CUDA device"):
        _model().enable_cuda_graphs()
    with pytest.raises(ValueError, match="CUDA device"):
        CudaGraphs(lambda x, plan: x, 32, torch.float32, torch.device("cpu"))


def test_layers_that_cannot_replay_are_refused(monkeypatch):
    model = _model(add_bias_kv=True)
    monkeypatch.setattr(type(model), "device", property(lambda self: torch.device("cuda")))
    with pytest.raises(ValueError, match="varlen kernel"):
        model.enable_cuda_graphs()


def test_an_eager_model_does_not_replay():
    model = _model()
    x = torch.randn(5, 32)
    assert model._replay(x, [5], True) is None
    assert model.cuda_graphs is None


def test_models_without_a_packed_self_attention_forward_are_refused(monkeypatch):
    layer = torch.nn.TransformerDecoderLayer(32, 4, 64, batch_first=True).eval()
    model = model_from_state_dict(module_config(layer), module_state(layer), "cpu", "float32")
    monkeypatch.setattr(type(model), "device", property(lambda self: torch.device("cuda")))
    with pytest.raises(ValueError, match="no packed self-attention forward"):
        model.enable_cuda_graphs()
