"""Regenerate the checked-in gRPC/protobuf Python code: ``python -m gyre.proto.gen [OUT_ROOT]``.

The ``.proto`` files are compiled as ``gyre/proto/NAME.proto`` (copied into a scratch include root), so the
generated ``*_pb2_grpc.py`` import ``from gyre.proto import NAME_pb2`` — gyre's import name, never the bare
``proto`` that proto-plus owns. Output lands in ``OUT_ROOT/proto/`` (the repository's ``proto/`` by default).
``tests/unit/proto/test_proto.py`` regenerates into a temp dir and fails if the checked-in files differ.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROTOS = ("replay.proto", "weights.proto", "reward_model.proto")


def generate(out_root: Path = REPO) -> list[Path]:
    """Run protoc (grpcio-tools) on every .proto; returns the generated file paths under ``OUT_ROOT/proto``.

    Raises ``RuntimeError`` naming the .proto protoc failed on.
    """
    from grpc_tools import protoc

    out = Path(out_root) / "proto"
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        src, gen = Path(scratch, "src", "gyre", "proto"), Path(scratch, "gen")
        src.mkdir(parents=True)
        gen.mkdir()
        for proto in PROTOS:
            shutil.copyfile(REPO / "proto" / proto, src / proto)
        for proto in PROTOS:
            args = ["protoc", f"-I{src.parents[1]}", f"--python_out={gen}", f"--pyi_out={gen}",
                    f"--grpc_python_out={gen}", str(src / proto)]
            if protoc.main(args) != 0:
                raise RuntimeError(f"protoc failed on proto/{proto}")
        for made in Path(gen, "gyre", "proto").glob("*_pb2*.py*"):
            shutil.copyfile(made, out / made.name)
    return sorted(out.glob("*_pb2*.py*"))


if __name__ == "__main__":
    for path in generate(Path(sys.argv[1]) if len(sys.argv) > 1 else REPO):
        print(path)
