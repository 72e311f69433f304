"""``bench.fanout`` at N = 16 (the suite's size): the learner sends every version once per subscriber without relays
and about once with them, every live subscriber gets the version when a relay dies under it, and versions that
change 3% of their elements cost the learner under a tenth of the model."""

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def test_fanout_bench_at_16_subscribers_prints_the_egress_of_each_phase():
    out = subprocess.run([sys.executable, "-m", "bench.fanout", "--subscribers", "16", "--model-mb", "2"],
                         cwd=REPO, capture_output=True, text=True, timeout=600, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    direct, relay, killed = result["direct"], result["relay"], result["relay_killed"]
    assert direct["egress_ratio"] > 15.9 and direct["relays"] == 0  # one copy per subscriber, headers aside
    assert relay["egress_ratio"] < 1.1 and relay["relays"] == 2 and relay["errors"] == 0
    assert result["egress_vs_direct"] < 0.07
    # a relay killed mid-version: its 7 children take that version from rollout 0's relay, not the learner
    assert killed["killed"] == 1 and killed["fallback_versions"] == 7 and killed["egress_ratio"] < 1.1
    delta = result["relay_delta"]  # 3% of the elements change per version: sparse deltas, through the relays
    assert delta["egress_ratio"] < 0.1 and 0.025 < delta["changed_fraction"] < 0.035 and delta["errors"] == 0
    assert all(p["p50_s"] <= p["p99_s"] and p["cpu_s"] > 0 for p in (direct, relay, killed, delta))
