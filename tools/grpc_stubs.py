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
PROTOS = ("model_config.proto", "grpc_service.proto")


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
    (out / PROTO_DIR / "model_config_pb2_grpc.py").unlink()  # no service in it: empty module
    return sorted((out / PROTO_DIR).glob("*_pb2*.py*"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT, help="output root (default: the repo)")
    args = parser.parse_args()
    for path in generate(args.out):
        print(path, file=sys.stderr)


if __name__ == "__main__":
    main()
