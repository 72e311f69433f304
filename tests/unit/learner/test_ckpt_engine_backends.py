"""A checkpoint save works when training runs on NCCL, which moves only CUDA tensors: the CPU tensor that
carries rank 0's pid (the temp directory's name on every rank) travels on the gloo control group.

Found on an H200 (tests/gpu/test_lockstep_cuda.py): every save of a CUDA learner failed with
``RuntimeError: No backend type associated with device type cpu``. Here the default group is gloo, so NCCL's
refusal is played by a test double of ``dist.broadcast`` that refuses a CPU tensor on the default group."""

from pathlib import Path

import torch.distributed as dist

from gyre.learner import ranks
from gyre.learner.checkpoint import engine as ckpt_engine
from gyre.learner.checkpoint.store import verify
from gyre.learner.checkpoint.request import CheckpointRequest
from gyre.learner.config import AlgorithmConfig, LearnerConfig
from gyre.learner.ds_setup import ensure_distributed
from gyre.learner.algo.kl_control import KLController
from tests.tiny_model import SMOLLM2_DIR


class _DeepSpeedDouble:
    def save_checkpoint(self, path: str, tag: str, save_latest: bool = True) -> None:
        (Path(path) / tag).mkdir(parents=True)
        (Path(path) / tag / "mp_rank_00_model_states.pt").write_bytes(b"state")


class _Learner:
    step = version = 3
    config = LearnerConfig(model=str(SMOLLM2_DIR))
    algo = AlgorithmConfig()
    config_hash = "h"
    kl_ctrl = KLController(0.0)
    engine = _DeepSpeedDouble()


def test_a_save_on_an_nccl_learner_sends_its_cpu_tensors_over_gloo(tmp_path, monkeypatch):
    ensure_distributed()  # gloo, a world of one
    real_broadcast = dist.broadcast

    def nccl_broadcast(tensor, src, group=None, **kw):
        if group is None and tensor.device.type == "cpu":  # what ProcessGroupNCCL answers a CPU tensor
            raise RuntimeError("No backend type associated with device type cpu")
        return real_broadcast(tensor, src, group=group, **kw)

    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")  # the default group is "NCCL"...
    monkeypatch.setattr(ranks, "_CONTROL", [])  # ...so control_group() makes its own gloo group
    monkeypatch.setattr(ckpt_engine.dist, "broadcast", nccl_broadcast)
    path = ckpt_engine.save_checkpoint(_Learner(), CheckpointRequest(tmp_path, fingerprint="f"))
    assert path == tmp_path / "global_step_3"
    assert verify(path).policy_version == 3
