"""The update does not depend on how the batch is cut: micro-batches of 1, 3 or all rows, or packed under three
token budgets (``learner.engine.micro_batch_tokens``), on 1 or 2 data-parallel ranks (token-balanced shares), give
the same gradient to fp32 rounding, for ``token-mean`` and ``seq-mean-token-mean`` with the KL and entropy terms
on. Every micro-batch is normalised by its whole mini-batch (``loss_agg_mode``); a normaliser taken from the
micro-batch or the rank's share instead moves the update by tens of percent (checked by planting one). A rank left
with fewer rows than the other's micro-batches runs an empty one at zero weight: the same update, no hang."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from tests.integration.split_grad_proc import MODES, SPLITS
from tests.rendezvous import rank_store

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(world: int, model, out) -> tuple[dict, dict]:
    store, rendezvous = rank_store(world)
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "RANK", "LOCAL_RANK",
                                                              "WORLD_SIZE")}
    env |= {"PYTHONPATH": REPO, "WORLD_SIZE": str(world), **rendezvous}
    procs = [subprocess.Popen([sys.executable, "-m", "tests.integration.split_grad_proc", str(model), str(out)],
                              env=env | {"RANK": str(r), "LOCAL_RANK": str(r)}, cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT) for r in range(world)]
    for proc in procs:
        log, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"rank exited {proc.returncode}:\n{log.decode()[-3000:]}"
    del store
    return load_file(out), json.loads(out.with_suffix(out.suffix + ".json").read_text())


def test_every_split_gives_the_same_update(tiny_llama, tmp_path):
    runs = {world: _run(world, tiny_llama, tmp_path / f"w{world}.safetensors") for world in (1, 2)}
    one_deltas, one_metrics = runs[1]
    for mode in MODES:
        ref = {k.split("/", 2)[2]: v for k, v in one_deltas.items() if k.startswith(f"{mode}/rows-all/")}
        assert max(float(d.abs().max()) for d in ref.values()) > 1e-5  # the step moved the weights
        ref_metrics = one_metrics[f"{mode}/rows-all"]
        for world, (deltas, metrics) in runs.items():
            for split in SPLITS:
                m = metrics[f"{mode}/{split}"]
                for key in ("loss", "grad_norm", "entropy", "kl_to_ref", "tokens"):
                    assert m[key] == pytest.approx(ref_metrics[key], rel=1e-5, abs=1e-7), (world, mode, split, key)
                for param, expected in ref.items():
                    got = deltas[f"{mode}/{split}/{param}"]
                    assert float((got - expected).abs().max()) <= 1e-7 + 1e-4 * float(expected.abs().max()), \
                        (world, mode, split, param)
    uneven = {k.split("/", 2)[2]: v for k, v in one_deltas.items() if k.startswith("uneven/")}
    for param, expected in uneven.items():  # one rank ran an empty micro-batch: same update, no hang
        got = runs[2][0][f"uneven/tokens-13/{param}"]
        assert float((got - expected).abs().max()) <= 1e-7 + 1e-4 * float(expected.abs().max()), param
    assert runs[2][1]["uneven/tokens-13"]["micro_batches"] == 3  # the empty one is not a micro-batch of metrics
    assert runs[2][1]["uneven/tokens-13"]["grad_norm"] == pytest.approx(one_metrics["uneven/tokens-13"]["grad_norm"],
                                                                        rel=1e-5)
    two = runs[2][1]
    assert two["token-mean/tokens-13"]["micro_batches"] == 6  # one row per micro-batch, 3 per rank
    assert two["token-mean/tokens-63"]["micro_batches"] == 2  # each rank packs its share into one
