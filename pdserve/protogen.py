"""Generates pdserve/v1/*_pb2*.py from protos/pdserve/v1/*.proto.

Run ``python -m pdserve.protogen`` after editing a .proto file; the generated code is
committed, and tests/test_protogen.py fails when it is stale.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "protos"
PROTO_DIR = PROTO_ROOT / "pdserve" / "v1"
OUT_DIR = REPO_ROOT / "pdserve" / "v1"


def generate(out_root: Path) -> list[Path]:
    """Compiles every .proto into ``out_root/pdserve/v1`` and returns the files written."""
    from grpc_tools import protoc

    protos = sorted(PROTO_DIR.glob("*.proto"))
    if not protos:
        raise FileNotFoundError(f"no .proto files under {PROTO_DIR}")
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *[str(p) for p in protos],
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed: " + " ".join(args))
    return sorted((out_root / "pdserve" / "v1").glob("*_pb2*.py*"))


def stale_files() -> list[str]:
    """Names of generated files that differ from what the .proto files produce now."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = {p.name: p.read_bytes() for p in generate(Path(tmp))}
    current = {p.name: p.read_bytes() for p in OUT_DIR.glob("*_pb2*.py*")}
    return sorted(n for n in fresh.keys() | current.keys() if fresh.get(n) != current.get(n))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--check", action="store_true", help="only report stale files")
    args = ap.parse_args(argv)
    if args.check:
        stale = stale_files()
        for name in stale:
            print(f"stale: pdserve/v1/{name}")
        return 1 if stale else 0
    for path in generate(REPO_ROOT):
        print(f"wrote {path.relative_to(REPO_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
