"""``bench.nccl``'s CPU dry run (``GYRE_BENCH_NCCL_CPU=1``: gloo instead of NCCL): the harness that
``tests/gpu/test_nccl_cuda.py`` runs on CUDA works end to end on a machine without a GPU — a learner process
(``WeightGroup`` behind a ``BackgroundPublisher``) and a receiver process (``NcclTransport``), a version delivered
bit-exact, a corrupted bucket refused and fetched over gRPC, the next version back in a re-formed group, and one
JSON line with every field. Checks behaviour, not speed (the dry run's GB/s mean nothing)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

from bench.nccl import TINY, model_shapes

REPO = Path(__file__).resolve().parents[3]


def test_cpu_dry_run_delivers_refuses_the_corrupt_version_and_prints_one_json_line():
    env = {**os.environ, "GYRE_BENCH_NCCL_CPU": "1", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-m", "bench.nccl", "--quick", "--model", "tiny"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    json_lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(json_lines) == 1 and out.stdout.strip().splitlines()[-1] == json_lines[0], out.stdout[-3000:]
    result = json.loads(json_lines[0])
    assert set(result) == {
        "device", "model", "version_gb", "version_bytes", "receivers", "rounds", "bucket_mb", "nccl_ratio",
        "nccl_ratio_range", "gyre_gb_s", "raw_gb_s", "first_version_s", "groups_formed", "bit_exact",
        "corrupt_refused", "receiver_group_versions", "exit_codes"}
    assert result["device"] == "cpu (gloo dry run)"  # no checksum_parity: it compares CUDA with CPU
    assert (result["model"], result["receivers"], result["rounds"]) == ("tiny", 1, 5)
    assert result["version_bytes"] == sum(2 * math.prod(shape) for _, shape in model_shapes(TINY))
    assert result["bit_exact"] is True, result
    assert result["corrupt_refused"] is True and result["groups_formed"] == 2, result
    assert result["receiver_group_versions"] == [7]  # warm-up + 5 rounds + the version after the corrupt one
    assert result["exit_codes"] == [0]
    low, high = result["nccl_ratio_range"]
    assert 0 < low <= result["nccl_ratio"] <= high
    timings = ("gyre_gb_s", "raw_gb_s", "first_version_s")
    assert all(isinstance(result[k], float) and 0 <= result[k] < math.inf for k in timings), result
