"""MPNet (all-mpnet-base-v2's architecture) against transformers' MPNetModel: the relative position
bias (its buckets, shared by every layer) on the padded, packed, hidden-state and attention-weight
paths, sequences past the 128-token bucket range, batch invariance in fp32/bf16/int8, and the
fast kernels that take no bias kept out of the way."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import mha_engine
from mha_engine import CheckpointError, TextEncoderModel, cpu_varlen, cuda_graphs
from mha_engine.packed_attention import use_varlen
from mha_engine.position_bias import relative_position_bucket
from mha_engine.varlen import make_plan

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
from tests import text_models as tm  # noqa: E402
from tests.support import FP32_TOL  # noqa: E402

TEXTS = ["the cat sat on the mat", "what is deep learning?", "hello", "a dog . a cat . a mat"]


@pytest.fixture(scope="module")
def mpnet(tmp_path_factory) -> tuple:
    reference = tm.build("mpnet")
    return reference, tm.save(reference, tmp_path_factory.mktemp("mpnet"))


def test_buckets_are_transformers() -> None:
    from transformers.models.mpnet.modeling_mpnet import MPNetEncoder

    relative = torch.arange(-1000, 1001)[None, :]
    want = MPNetEncoder.relative_position_bucket(relative, num_buckets=32, max_distance=128)
    assert torch.equal(relative_position_bucket(relative), want)


def test_token_states_equal_transformers_padded_and_packed(mpnet) -> None:
    reference, path = mpnet
    model = mha_engine.load_model(path)
    assert isinstance(model, TextEncoderModel) and model.model_type == "mpnet"
    assert model.config.relative_attention_num_buckets == 32 and model.max_seq_len == 38
    ids, mask = tm.random_padded([7, 3, 12, 7, 1, 30])
    with torch.no_grad():
        want = reference(input_ids=ids, attention_mask=mask).last_hidden_state
    real = mask.bool()
    torch.testing.assert_close(model.encode(ids, mask)[real], want[real], **FP32_TOL)
    packed = model.encode_varlen([row[m] for row, m in zip(ids, real, strict=True)])
    for got, w, m in zip(packed, want, real, strict=True):
        torch.testing.assert_close(got, w[m], **FP32_TOL)


def test_sequences_past_the_bucket_range(tmp_path: Path) -> None:
    """Distances beyond 128 tokens share the last bucket: 150 and 300 tokens, padded and packed."""
    reference = tm.build("mpnet", max_position_embeddings=320)
    model = mha_engine.load_model(tm.save(reference, tmp_path))
    ids, mask = tm.random_padded([300, 150])
    with torch.no_grad():
        want = reference(input_ids=ids, attention_mask=mask).last_hidden_state
    real = mask.bool()
    torch.testing.assert_close(model.encode(ids, mask)[real], want[real], **FP32_TOL)
    packed = model.encode_varlen([ids[0], ids[1, :150]])
    torch.testing.assert_close(packed[1], want[1, :150], **FP32_TOL)


def test_hidden_state_api_and_attention_weights(mpnet) -> None:
    """The tensor API runs the encoder alone (MPNetModel.encoder, its bias included); the
    attention weights are transformers' probabilities, layer by layer."""
    reference, path = mpnet
    model = mha_engine.load_model(path)
    hidden = torch.randn(2, 9, tm.D, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = reference.encoder(hidden, output_attentions=True, return_dict=True)
    torch.testing.assert_close(model(hidden), out.last_hidden_state, **FP32_TOL)
    [packed] = model.forward_varlen([hidden[0]])
    torch.testing.assert_close(packed, out.last_hidden_state[0], **FP32_TOL)
    _, weights = model.attention_weights(hidden)  # (L, B, H, T, T)
    torch.testing.assert_close(weights, torch.stack(out.attentions), **FP32_TOL)


def test_a_sequences_numbers_never_depend_on_its_batch(mpnet) -> None:
    """Bit for bit: alone, among other lengths, and beside others of its own length (one SDPA
    call with the shared bias broadcast over the group)."""
    _, path = mpnet
    model = mha_engine.load_model(path)
    seqs = [ids for ids, _ in tm.tokenize(path, TEXTS)]
    seqs.append(seqs[0].flip(0))  # same length as the first, other tokens
    alone = [model.encode_varlen([s])[0] for s in seqs]
    together = model.encode_varlen(seqs)
    assert all(torch.equal(a, b) for a, b in zip(alone, together, strict=True))


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])
def test_bf16_and_int8_stay_close_and_batch_invariant(mpnet, dtype: str) -> None:
    reference, path = mpnet
    model = mha_engine.load_model(path, dtype=dtype)
    encoded = tm.tokenize(path, TEXTS)
    seqs = [ids for ids, _ in encoded]
    ids, mask, _ = tm.padded(encoded)
    with torch.no_grad():
        hidden = reference(input_ids=ids, attention_mask=mask).last_hidden_state
    m = mask[..., None].float()
    want = (hidden * m).sum(1) / m.sum(1)
    got = model.embed_varlen(seqs)
    # measured here: largest difference 5.6e-3 (bf16), 2.3e-3 (int8) on values of order 1
    torch.testing.assert_close(got, want, atol=2e-2, rtol=0)
    assert torch.equal(got, torch.cat([model.embed_varlen([one]) for one in seqs]))


def test_a_bucket_count_transformers_would_not_use_is_refused(tmp_path: Path) -> None:
    path = tm.save(tm.build("mpnet", relative_attention_num_buckets=64), tmp_path)
    with pytest.raises(
        CheckpointError, match="relative_attention_num_buckets is 64; MPNet uses 32"
    ):
        mha_engine.load_model(path)


def test_the_kernels_that_take_no_bias_are_not_used(mpnet, monkeypatch) -> None:
    """MPNet never runs the CPU varlen kernel, a plan with a bias never takes the CUDA one
    (counted as grouped), nor CUDA graphs (refused at capture: the service logs, runs eagerly)."""
    _, path = mpnet
    model = mha_engine.load_model(path)
    seqs = [ids for ids, _ in tm.tokenize(path, TEXTS)]
    want = model.encode_varlen(seqs)

    def kernel(*args, **kwargs):
        raise AssertionError("the CPU varlen kernel ran on an MPNet layer")

    if cpu_varlen.KERNEL.library() is None:
        pytest.skip("the CPU varlen kernel is not built here")
    monkeypatch.setattr(cpu_varlen, "varlen_attention", kernel)
    assert all(torch.equal(a, b) for a, b in zip(model.encode_varlen(seqs), want, strict=True))
    attn = model.attention_layers()[0]
    plan = make_plan([5, 7])
    query = SimpleNamespace(is_cuda=True, dtype=torch.float16)
    assert use_varlen(attn, query, plan)
    assert not use_varlen(attn, query, plan, lambda t, s: torch.zeros(1, tm.HEADS, t, s))
    monkeypatch.setattr(type(model), "device", property(lambda self: torch.device("cuda", 0)))
    with pytest.raises(ValueError, match="no position bias"):
        cuda_graphs.capture(model, True, False, 64, 8, 4, None)


def test_positions_count_from_padding_index_1_whatever_the_config_says(tmp_path: Path) -> None:
    """transformers' MPNetEmbeddings fix the padding index at 1; config.pad_token_id 0 must not
    move the positions (real tokens from 2)."""
    reference = tm.build("mpnet", pad_token_id=0)
    model = mha_engine.load_model(tm.save(reference, tmp_path))
    ids, mask = tm.random_padded([9, 4])  # padded with id 1, as the tokenizer would
    with torch.no_grad():
        want = reference(input_ids=ids, attention_mask=mask).last_hidden_state
    real = mask.bool()
    torch.testing.assert_close(model.encode(ids, mask)[real], want[real], **FP32_TOL)
    [packed] = model.encode_varlen([ids[0]])
    torch.testing.assert_close(packed, want[0], **FP32_TOL)


def test_batch_invariance_at_a_realistic_size(tmp_path: Path) -> None:
    """Wide (256) and long (about 1,600 tokens) enough that torch splits elementwise ops among
    threads at places that depend on the batch's size; lengths past 128 share the last bucket."""
    reference = tm.build(
        "mpnet", hidden_size=256, intermediate_size=384, max_position_embeddings=514
    )
    model = mha_engine.load_model(tm.save(reference, tmp_path))
    g = torch.Generator().manual_seed(5)
    lengths = [300, 33, 33, 120, 1, 500, 64, 200, 200, 100]
    seqs = [torch.randint(2, len(tm.VOCAB), (n,), generator=g) for n in lengths]
    together = model.encode_varlen(seqs)
    for one, got in zip(seqs, together, strict=True):
        assert torch.equal(model.encode_varlen([one])[0], got)


def test_a_config_without_layer_norm_eps_takes_transformers_default(tmp_path: Path) -> None:
    """MPNetConfig's default eps is 1e-12 (not RoBERTa-like checkpoints' 1e-5)."""
    path = tm.save(tm.build("mpnet"), tmp_path)
    config = json.loads((path / "config.json").read_text())
    del config["layer_norm_eps"]
    (path / "config.json").write_text(json.dumps(config))
    model = mha_engine.load_model(path)
    assert model.config.layer_norm_eps == transformers.MPNetConfig().layer_norm_eps == 1e-12
