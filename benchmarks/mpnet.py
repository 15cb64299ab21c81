"""MPNet sentence embeddings: the engine's packed forward (relative position bias included) against
transformers' MPNetModel plus mean pooling, sentences/s on the same batches, interleaved.

Run `python -m benchmarks.mpnet [--rounds 5] [--seconds 3] [--batch 32 --batch 1]` from the
repository root under `flock /work/bench.lock` (needs transformers). The model has
all-mpnet-base-v2's shape (12 layers, 768 wide, 12 heads, 30,527-entry vocabulary), randomly
initialised and saved as safetensors in a temporary directory: its weights do not change the
cost. Sentences are seeded random ids of 7-37 tokens (the lengths of benchmarks.embeddings'
sentences under a BERT tokenizer). transformers runs each batch padded to its longest sentence
with an attention mask (its MPNet has eager attention only: no SDPA implementation); the engine
runs it packed. Both in float32, then the engine in bfloat16 beside them.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

import mha_engine
from benchmarks.text_models import rate

SHAPE = dict(
    hidden_size=768, num_attention_heads=12, num_hidden_layers=12, intermediate_size=3072,
    vocab_size=30527, max_position_embeddings=514, pad_token_id=1, layer_norm_eps=1e-5,
)  # fmt: skip


def batch(size: int, seed: int = 0) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Unpadded id sequences and the same batch right-padded with its attention mask."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(7, 38, (size,), generator=g).tolist()
    seqs = [torch.randint(3, SHAPE["vocab_size"], (n,), generator=g) for n in lengths]
    padded = torch.ones(size, max(lengths), dtype=torch.long)  # 1: MPNet's pad id
    mask = torch.zeros_like(padded)
    for row, one in enumerate(seqs):
        padded[row, : len(one)], mask[row, : len(one)] = one, 1
    return seqs, padded, mask


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--batch", type=int, action="append")
    args = parser.parse_args()
    from transformers import MPNetConfig, MPNetModel

    torch.manual_seed(0)
    reference = MPNetModel(MPNetConfig(**SHAPE), add_pooling_layer=False).eval()
    with tempfile.TemporaryDirectory() as tmp:
        reference.save_pretrained(Path(tmp), safe_serialization=True)
        fp32 = mha_engine.load_model(tmp)
        bf16 = mha_engine.load_model(tmp, dtype="bfloat16")
    print(
        f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC, {platform.processor() or 'cpu'}, "
        f"torch {torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}, "
        f"threads {torch.get_num_threads()}, load avg {os.getloadavg()[0]:.2f}"
    )
    for size in args.batch or [32, 1]:
        compare(reference, fp32, bf16, size, args.rounds, args.seconds)


def compare(reference, fp32, bf16, size: int, rounds: int, seconds: float) -> None:
    """One batch size: the three runs interleaved, a markdown table of their medians."""
    seqs, padded, mask = batch(size)

    @torch.inference_mode()
    def theirs() -> torch.Tensor:
        hidden = reference(input_ids=padded, attention_mask=mask).last_hidden_state
        m = mask[..., None].float()
        return (hidden * m).sum(1) / m.sum(1)  # (B, D)

    steps = {
        "engine fp32": lambda: fp32.embed_varlen(seqs),
        "transformers fp32": theirs,
        "engine bf16": lambda: bf16.embed_varlen(seqs),
    }
    diff = (steps["engine fp32"]() - theirs()).abs().max().item()
    diff16 = (steps["engine bf16"]() - theirs()).abs().max().item()
    print(
        f"\nbatch {size}, {min(map(len, seqs))}-{max(map(len, seqs))} tokens; max |engine - "
        f"transformers| fp32 {diff:.2e}, bf16 {diff16:.2e}"
    )
    rows: dict[str, list[float]] = {name: [] for name in steps}
    for i in range(rounds):
        order = list(steps.items())
        for name, step in order if i % 2 == 0 else order[::-1]:
            step()  # warm
            rows[name].append(rate(step, size, seconds))
        print(f"round {i}: " + ", ".join(f"{k} {v[-1]:.1f}/s" for k, v in rows.items()))
    base = statistics.median(rows["transformers fp32"])
    print("\n| batch | runs | sentences/s (median) | min-max | vs transformers fp32 |")
    print("|---:|---|---:|---:|---:|")
    for name, got in rows.items():
        med = statistics.median(got)
        spread = f"{min(got):.1f}-{max(got):.1f}"
        print(f"| {size} | {name} | {med:.1f} | {spread} | {med / base:.2f}x |")


if __name__ == "__main__":
    main()
