"""Regenerate the committed gRPC stubs in loraserve/v1 from proto/ (`make protos`).

The stubs are committed so that running loraserve needs no protoc; tests/project/test_project.py checks
they match the .proto sources.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
OUT = ROOT / "loraserve" / "v1"


def generate(out_root: Path) -> list[Path]:
    """Run protoc (grpcio-tools) on every .proto into out_root/loraserve/v1; returns the files written."""
    from grpc_tools import protoc

    sources = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{_include_dir()}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *sources,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {sources}")
    return sorted((out_root / "loraserve" / "v1").glob("*_pb2*"))


def _include_dir() -> str:
    import grpc_tools

    return str(Path(grpc_tools.__file__).parent / "_proto")


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        for path in generate(Path(tmp)):
            shutil.copy(path, OUT / path.name)
            print(f"wrote {(OUT / path.name).relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
