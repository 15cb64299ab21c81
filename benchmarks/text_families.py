"""MPNet, ModernBERT, Qwen3, Qwen2, EuroBERT, Gemma 3, NomicBERT, GTE and JinaBERT sentence
embeddings: the engine's packed forward against transformers' model plus pooling (mean; Qwen3,
Qwen2: last token), sentences/s on the same batches, interleaved.

Run `python -m benchmarks.text_families [--family
mpnet|modernbert|qwen3|qwen2|eurobert|gemma3_text|nomic_bert|gte|jina_bert] [--rounds 5]
[--seconds 3]
[--batch 32 --batch 1]` from the repository root under `flock /work/bench.lock` (needs
transformers). The models have the published shapes, randomly initialised and saved as
safetensors in a temporary directory (weights do not change the cost): all-mpnet-base-v2's (12
layers, 768 wide, 12 heads), ModernBERT-base's (22 layers, 768 wide, 12 heads, a 1,152-wide
GeGLU, every third layer global, the others a 128-token window), Qwen3-Embedding-0.6B's (28
causal layers, 1,024 wide, 16 query and 8 K/V heads of 128, a 3,072-wide SwiGLU), gte-
Qwen2-1.5B-instruct's (28 causal layers, 1,536 wide, 12 query and 2 K/V heads of 128, Q/K/V
biases, an 8,960-wide SwiGLU), EmbeddingGemma-300m's (24 bidirectional layers, 768 wide, 3 query
and 1 K/V head of 256, every sixth layer full, the others a window of 256 each way),
EuroBERT-210m's (12 bidirectional Llama layers, 768 wide, 12 heads, a 3,072-wide SwiGLU), nomic-
embed-text-v1.5's (12 post-norm rotary layers, 768 wide, 12 heads, a 3,072-wide SwiGLU) and gte-
multilingual-base's (the same shape with biases, a GELU-gated feed-forward and a 250,048-token
table) and jina-embeddings-v2-base-en's (12 post-norm BERT layers with ALiBi, 768 wide, 12 heads,
a 3,072-wide GEGLU; transformers has no JinaBERT class, so its side is the reference the tests
use: transformers' BertModel with each layer's intermediate a GLU and ALiBi as a float mask built
per batch, as JinaBERT's own code adds it, SDPA). Sentences are seeded random ids of 7-37
tokens (the lengths of benchmarks.embeddings' sentences under a BERT tokenizer), or of
`--min-len`-`--max-len`. transformers runs each batch
padded to its longest sentence with an attention mask (MPNet: eager attention, the only one it
has; the others: SDPA); the engine runs it packed. Both in float32, then the engine in bfloat16
beside them.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

import mha_engine
from benchmarks.text_models import interleaved, machine_line

SHAPES = {
    "mpnet": dict(
        hidden_size=768, num_attention_heads=12, num_hidden_layers=12, intermediate_size=3072,
        vocab_size=30527, max_position_embeddings=514, pad_token_id=1, layer_norm_eps=1e-5,
    ),
    "modernbert": dict(
        hidden_size=768, num_attention_heads=12, num_hidden_layers=22, intermediate_size=1152,
        vocab_size=50368, max_position_embeddings=8192, pad_token_id=1, local_attention=128,
        global_attn_every_n_layers=3, bos_token_id=2, eos_token_id=3, cls_token_id=2,
        sep_token_id=3,
    ),
    "qwen3": dict(
        hidden_size=1024, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        num_hidden_layers=28, intermediate_size=3072, vocab_size=151669,
        max_position_embeddings=32768, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        pad_token_id=1,
    ),
    "qwen2": dict(
        hidden_size=1536, num_attention_heads=12, num_key_value_heads=2, num_hidden_layers=28,
        intermediate_size=8960, vocab_size=151646, max_position_embeddings=131072,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, pad_token_id=1,
    ),
    "gemma3_text": dict(
        hidden_size=768, num_attention_heads=3, num_key_value_heads=1, head_dim=256,
        query_pre_attn_scalar=256, num_hidden_layers=24, intermediate_size=1152,
        vocab_size=262144, max_position_embeddings=2048, sliding_window=512,
        use_bidirectional_attention=True, pad_token_id=0, sliding_window_pattern=6,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
    ),
    "eurobert": dict(
        hidden_size=768, num_attention_heads=12, num_key_value_heads=12, num_hidden_layers=12,
        intermediate_size=3072, vocab_size=128256, max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": 250000.0}, pad_token_id=1,
    ),
    "nomic_bert": dict(
        hidden_size=768, num_attention_heads=12, num_hidden_layers=12, intermediate_size=3072,
        vocab_size=30528, max_position_embeddings=2048, type_vocab_size=2, pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
    ),
    "gte": dict(
        hidden_size=768, num_attention_heads=12, num_hidden_layers=12, intermediate_size=3072,
        vocab_size=250048, max_position_embeddings=8192, type_vocab_size=1, pad_token_id=1,
        rope_parameters={"rope_type": "default", "rope_theta": 160000.0},
    ),
    "jina_bert": dict(
        hidden=768, heads=12, num_hidden_layers=12, intermediate_size=3072, vocab_size=30528,
        max_position_embeddings=8192, type_vocab_size=2, pad_token_id=0,
    ),
}  # fmt: skip
POOLING = {"qwen3": "last_token", "qwen2": "last_token"}  # the others: mean


def batch(
    size: int, vocab: int, lengths: tuple[int, int], seed: int = 0
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Unpadded id sequences and the same batch right-padded with its attention mask."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lengths[0], lengths[1] + 1, (size,), generator=g).tolist()
    seqs = [torch.randint(3, vocab, (n,), generator=g) for n in lens]
    padded = torch.ones(size, max(lens), dtype=torch.long)  # 1: the models' pad id
    mask = torch.zeros_like(padded)
    for row, one in enumerate(seqs):
        padded[row, : len(one)], mask[row, : len(one)] = one, 1
    return seqs, padded, mask


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--batch", type=int, action="append")
    parser.add_argument("--family", choices=sorted(SHAPES), default="mpnet")
    parser.add_argument("--min-len", type=int, default=7)
    parser.add_argument("--max-len", type=int, default=37)
    args = parser.parse_args()
    import transformers

    torch.manual_seed(0)
    jina = args.family == "jina_bert"
    with tempfile.TemporaryDirectory() as tmp:
        if jina:  # transformers' BertModel computing JinaBERT (the tests' reference)
            from tests import jina_models

            reference = jina_models.reference(**SHAPES[args.family])
            reference.set_attn_implementation("sdpa")
            jina_models.hub_form(reference, Path(tmp) / "jina")
            tmp = str(Path(tmp) / "jina")
        else:
            config = transformers.AutoConfig.for_model(args.family, **SHAPES[args.family])
            attention = "eager" if args.family == "mpnet" else "sdpa"
            reference = transformers.AutoModel.from_config(
                config, attn_implementation=attention
            ).eval()
            reference.save_pretrained(Path(tmp), safe_serialization=True)
        fp32 = mha_engine.load_model(tmp)
        bf16 = mha_engine.load_model(tmp, dtype="bfloat16")
    print(machine_line(args.family))
    for size in args.batch or [32, 1]:
        seqs = batch(size, reference.config.vocab_size, (args.min_len, args.max_len))
        pooling = POOLING.get(args.family, "mean")
        alibi = reference.config.num_attention_heads if jina else 0
        compare(reference, fp32, bf16, seqs, args.rounds, args.seconds, pooling, alibi)


def compare(
    reference,
    fp32,
    bf16,
    seqs: tuple,
    rounds: int,
    seconds: float,
    pooling: str = "mean",
    alibi: int = 0,
) -> None:
    """One batch: the three runs interleaved, a markdown table of their medians. alibi: the
    head count of a JinaBERT reference, whose mask carries ALiBi (built per batch)."""
    seqs, padded, mask = seqs
    size = len(seqs)

    @torch.inference_mode()
    def theirs() -> torch.Tensor:
        if alibi:
            from tests import jina_models

            attention_mask = jina_models.alibi_mask(mask, alibi)
        else:
            attention_mask = mask
        hidden = reference(input_ids=padded, attention_mask=attention_mask).last_hidden_state
        if pooling == "last_token":  # right padding: each row's last real token
            return hidden[torch.arange(size), mask.sum(1) - 1]  # (B, D)
        m = mask[..., None].float()
        return (hidden * m).sum(1) / m.sum(1)  # (B, D)

    steps = {
        "engine fp32": lambda: fp32.embed_varlen(seqs, pooling=pooling),
        "transformers fp32": theirs,
        "engine bf16": lambda: bf16.embed_varlen(seqs, pooling=pooling),
    }
    diff = (steps["engine fp32"]() - theirs()).abs().max().item()
    diff16 = (steps["engine bf16"]() - theirs()).abs().max().item()
    print(
        f"\nbatch {size}, {min(map(len, seqs))}-{max(map(len, seqs))} tokens; max |engine - "
        f"transformers| fp32 {diff:.2e}, bf16 {diff16:.2e}"
    )
    interleaved(steps, size, rounds, seconds, "transformers fp32", "sentences")


if __name__ == "__main__":
    main()
