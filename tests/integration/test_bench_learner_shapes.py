"""``python -m bench.learner --shape qwen2-tiny --lengths grpo-math-small --quick`` runs on CPU and prints its one
JSON line; the ratio is reported, not asserted (tests assert behaviour, not speed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def test_quick_shape_bench_prints_one_json_line(tmp_path):
    env = os.environ | {"PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "bench.learner", "--shape", "qwen2-tiny", "--lengths",
                           "grpo-math-small", "--quick", "--models-dir", str(tmp_path)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(json.dumps(result))
    assert result["rows"] == 32 and result["real_tokens"] > 1000 and result["pad_fraction"] == 0.0
    assert result["micro_batches"] >= 2 and 0.0 < result["bare_pad_fraction"] < result["rowcount8_pad_fraction"]
    for key in ("step_s", "bare_step_s", "tokens_per_s", "mfu", "sorted_budget_ratio", "peak_memory_gib",
                "publish_blocking_s", "publish_inline_s", "publish_background_s", "publish_ratio"):
        assert result[key] > 0, key
    assert "measured" in result["device"] and result["device_peak_tflops"] > 0
