"""The broadcast weight transport over NCCL on a real CUDA device (skipped without one; CI has none).

Runs ``python -m bench.nccl --quick``: a learner process (publisher, gRPC ``Announce``, ``WeightGroup`` behind the
``BackgroundPublisher``) and a rollout receiver process (``NcclTransport``: GPU staging buckets) in the NCCL group the
learner forms. Checks behaviour, not speed: checksums agree between CUDA and CPU, a delivered version is bit-exact,
a version whose first bucket has a flipped bit is refused and fetched over gRPC, and the next one is back in a group.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_nccl_transport_on_cuda_delivers_verifies_and_refuses():
    out = subprocess.run([sys.executable, "-m", "bench.nccl", "--quick"], cwd=Path(__file__).resolve().parents[2],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print(json.dumps(result))
    assert result["checksum_parity"] is True, result["checksum_mismatches"]
    assert result["bit_exact"] is True
    assert result["corrupt_refused"] is True and result["groups_formed"] == 2
    assert result["exit_codes"] == [0]
