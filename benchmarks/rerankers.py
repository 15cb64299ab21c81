"""Qwen3-Reranker scoring: the engine's packed forward with its one-row LogitScore head against
transformers' Qwen3ForCausalLM as sentence-transformers' CrossEncoder runs it (left-padded batch,
`logits_to_keep=1`, the "yes" logit minus the "no" logit), pairs/s on the same batches,
interleaved.

Run `python -m benchmarks.rerankers [--rounds 3] [--seconds 2] [--batch 8 --batch 32]
[--min-len 120 --max-len 320]` from the repository root under `flock /work/bench.lock` (needs
transformers). The model has Qwen3-Reranker-0.6B's published shape (28 causal layers, 1,024 wide,
16 query and 8 K/V heads of 128, a 3,072-wide SwiGLU, 151,669 tokens, the LM head tied to the
token table), randomly initialised and saved as safetensors with sentence-transformers' LogitScore
files in a temporary directory (weights do not change the cost). A pair is its chat template
(about 70 tokens), a query and a passage: seeded random ids of `--min-len`-`--max-len` tokens.
Both in float32, then the engine in bfloat16 beside them.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

import mha_engine
from benchmarks.text_families import SHAPES, batch
from benchmarks.text_models import interleaved, machine_line

YES, NO = 9693, 2152  # Qwen3's "yes" and "no" token ids
LOGIT_SCORE = "sentence_transformers.cross_encoder.modules.logit_score.LogitScore"


def save_reranker(reference, directory: Path) -> None:
    """The causal LM plus sentence-transformers' files naming the LogitScore tokens."""
    reference.save_pretrained(directory, safe_serialization=True)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_LogitScore", "type": LOGIT_SCORE},
    ]
    (directory / "modules.json").write_text(json.dumps(modules))
    (directory / "1_LogitScore").mkdir()
    config = {"true_token_id": YES, "false_token_id": NO}
    (directory / "1_LogitScore" / "config.json").write_text(json.dumps(config))


def left_padded(seqs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch padded on the left, as sentence-transformers pads a causal LM's inputs."""
    width = max(len(s) for s in seqs)
    ids = torch.ones(len(seqs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, one in enumerate(seqs):
        ids[row, width - len(one) :], mask[row, width - len(one) :] = one, 1
    return ids, mask


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--batch", type=int, action="append")
    parser.add_argument("--min-len", type=int, default=120)
    parser.add_argument("--max-len", type=int, default=320)
    args = parser.parse_args()
    import transformers

    torch.manual_seed(0)
    shape = {**SHAPES["qwen3"], "tie_word_embeddings": True}
    config = transformers.AutoConfig.for_model("qwen3", **shape)
    reference = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="sdpa"
    ).eval()
    with tempfile.TemporaryDirectory() as tmp:
        save_reranker(reference, Path(tmp))
        fp32 = mha_engine.load_model(tmp)
        bf16 = mha_engine.load_model(tmp, dtype="bfloat16")
    print(machine_line("Qwen3-Reranker"))
    for size in args.batch or [8, 32]:
        seqs, _, _ = batch(size, config.vocab_size, (args.min_len, args.max_len))
        compare(reference, fp32, bf16, seqs, args.rounds, args.seconds)


def compare(reference, fp32, bf16, seqs: list[torch.Tensor], rounds: int, seconds: float) -> None:
    """One batch: the three runs interleaved, a markdown table of their medians."""
    ids, mask = left_padded(seqs)
    size = len(seqs)

    @torch.inference_mode()
    def theirs() -> torch.Tensor:
        logits = reference(input_ids=ids, attention_mask=mask, logits_to_keep=1).logits[:, -1]
        return logits[:, YES] - logits[:, NO]  # (B,)

    steps = {
        "engine fp32": lambda: fp32.classify_varlen(seqs)[:, 0],
        "transformers fp32": theirs,
        "engine bf16": lambda: bf16.classify_varlen(seqs)[:, 0],
    }
    diff = (steps["engine fp32"]() - theirs()).abs().max().item()
    diff16 = (steps["engine bf16"]() - theirs()).abs().max().item()
    print(
        f"\nbatch {size}, {min(map(len, seqs))}-{max(map(len, seqs))} tokens; max |engine - "
        f"transformers| fp32 {diff:.2e}, bf16 {diff16:.2e} (left padding moves RoPE's absolute "
        "positions: fp32 rounding, not the same sums)"
    )
    interleaved(steps, size, rounds, seconds, "transformers fp32", "pairs")


if __name__ == "__main__":
    main()
