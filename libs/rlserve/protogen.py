"""Generate the Python stubs of `protos/rlserve/v1/*.proto` into `libs/rlserve/v1/`.

The stubs are committed so that Serve's gRPC proxy, Ray workers and clients
import them with no build step; `tests/unit/test_protos.py` fails when they
are stale. Run `make protos` after editing a .proto file.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO / "protos"
OUT_ROOT = REPO / "libs"


def proto_files() -> list[Path]:
    return sorted((PROTO_ROOT / "rlserve" / "v1").glob("*.proto"))


def generate(out_root: Path = OUT_ROOT) -> list[Path]:
    """Run protoc (from grpcio-tools) on every proto; return the files written."""
    import grpc_tools
    from grpc_tools import protoc

    include = str(Path(grpc_tools.__file__).parent / "_proto")
    files = [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]
    args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={out_root}",
            f"--pyi_out={out_root}", f"--grpc_python_out={out_root}", *files]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    out_dir = out_root / "rlserve" / "v1"
    init = out_dir / "__init__.py"
    if not init.exists():
        init.write_text('"""Generated gRPC/protobuf stubs of protos/rlserve/v1 (make protos)."""\n')
    return sorted(out_dir.glob("*_pb2*.py*"))


if __name__ == "__main__":
    for path in generate():
        print(path.relative_to(REPO), file=sys.stderr)
