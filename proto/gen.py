"""Regenerate the checked-in gRPC/protobuf Python code: ``python -m proto.gen [OUT_ROOT]``.

``tests/unit/proto/test_proto.py`` regenerates into a temp dir and fails if the checked-in files differ.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROTOS = ("proto/replay.proto", "proto/weights.proto", "proto/reward_model.proto")


def generate(out_root: Path = REPO) -> list[Path]:
    """Run protoc (grpcio-tools) on every .proto; returns the generated file paths under ``out_root``."""
    from grpc_tools import protoc

    (Path(out_root) / "proto").mkdir(parents=True, exist_ok=True)
    for proto in PROTOS:
        args = ["protoc", f"-I{REPO}", f"--python_out={out_root}", f"--pyi_out={out_root}",
                f"--grpc_python_out={out_root}", str(REPO / proto)]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {proto}")
    return sorted(Path(out_root, "proto").glob("*_pb2*.py*"))


if __name__ == "__main__":
    for path in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else REPO):
        print(path)
