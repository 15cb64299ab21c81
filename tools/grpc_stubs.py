"""Generate service/grpc/*_pb2*.py from service/grpc/*.proto with grpcio-tools.

    python tools/grpc_stubs.py            # rewrite the committed modules in place
    python tools/grpc_stubs.py --out DIR  # write them under DIR/service/grpc/ (the test diffs)

The generated modules are committed (the server needs no compiler at run time); they depend on
the grpcio-tools version pinned in pyproject.toml's test extra, and
tests/service/test_grpc_stubs.py fails when the committed files differ from a fresh run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO_DIR = "service/grpc"
PROTOS = (
    "model_config.proto",
    "grpc_service.proto",
    "tei.proto",
    "health.proto",
    "reflection.proto",
)
# messages only: their _pb2_grpc.py is empty
NO_SERVICE = ("model_config",)


def generate(out: Path) -> list[Path]:
    """Run protoc (grpcio-tools' bundled one) into `out`; returns the files written."""
    from grpc_tools import protoc

    (out / PROTO_DIR).mkdir(parents=True, exist_ok=True)
    include = Path(protoc.__file__).parent / "_proto"  # protobuf's well-known types
    args = [
        "grpc_tools.protoc",
        f"-I{ROOT}",
        f"-I{include}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *(f"{PROTO_DIR}/{name}" for name in PROTOS),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    for name in NO_SERVICE:
        (out / PROTO_DIR / f"{name}_pb2_grpc.py").unlink()
    for name in PROTOS:
        _use_private_pool(out / PROTO_DIR / name.replace(".proto", "_pb2.py"))
    return sorted((out / PROTO_DIR).glob("*_pb2*.py*"))


def _use_private_pool(module: Path) -> None:
    """Register the module's descriptors in service.grpc.pool.POOL instead of protobuf's
    default pool, where a Triton client's own `inference.*` definitions may already be."""
    text = module.read_text()
    default = "_descriptor_pool.Default().AddSerializedFile("
    marker = "# @@protoc_insertion_point(imports)\n"
    if text.count(default) != 1 or text.count(marker) != 1:
        raise RuntimeError(f"unexpected protoc output in {module}; update _use_private_pool")
    text = text.replace(default, "_POOL.AddSerializedFile(")
    text = text.replace(marker, marker + "from service.grpc.pool import POOL as _POOL\n")
    module.write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT, help="output root (default: the repo)")
    args = parser.parse_args()
    for path in generate(args.out):
        print(path, file=sys.stderr)


if __name__ == "__main__":
    main()
