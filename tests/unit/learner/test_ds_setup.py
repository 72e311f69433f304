"""``learner.ds_setup.ensure_distributed``: a world of one binds its rendezvous on port 0 and keeps it, so no
other process can take the port between choosing and binding (seen on a GPU machine: ``DistNetworkError ...
EADDRINUSE`` after other GPU tests had run, from a port picked by binding port 0, closing and binding later)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from gyre.learner.ds_setup import ensure_distributed

REPO = Path(__file__).resolve().parents[3]
TORCH_DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE")

# A fresh process (torch.distributed is process-wide) in which every port released after a bind to port 0 is
# taken at once by another socket (tests.fakes.PortThief), as another process on a busy machine might.
WORLD_OF_ONE = """
import torch.distributed as dist
from tests.fakes import PortThief
thief = PortThief().install()
from gyre.learner.ds_setup import ensure_distributed
ensure_distributed()
print("world", dist.get_world_size(), "rank", dist.get_rank(), "taken", thief.taken)
"""


def test_a_world_of_one_starts_though_every_released_port_is_taken_at_once():
    env = {k: v for k, v in os.environ.items() if k not in TORCH_DIST_ENV} | {"PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", WORLD_OF_ONE], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines()[-1] == "world 1 rank 0 taken []"


def test_a_larger_world_without_a_rendezvous_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    for key in ("RANK", "LOCAL_RANK"):
        monkeypatch.setenv(key, "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(ValueError, match=r"^WORLD_SIZE \(2\) > 1 needs MASTER_ADDR and MASTER_PORT"):
        ensure_distributed()
