"""The multi-rank learner's command channel (``learner.ranks``) across two real gloo processes: rank 0's
``LeaderEngine`` announces each collective call and rank 1's ``follow`` runs the same call with the same
arguments and bit-identical batch tensors, in order, until ``stop``; an unknown command is refused by name.
The engines are recording test doubles: what is under test is the channel, not DeepSpeed."""

from __future__ import annotations

import datetime
import json
import multiprocessing as mp
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from gyre.learner import ranks
from gyre.learner.batch import TrainBatch
from gyre.learner.checkpoint.request import CheckpointRequest
from tests.fakes import PortThief
from tests.rendezvous import rank_store


class RecordingEngine:
    """Records each call with a digest of its arguments; ``zero_stage`` 3 so weights are a collective too."""

    def __init__(self) -> None:
        self.calls: list = []
        self.step = self.version = 0
        self.config = type("Cfg", (), {"zero_stage": 3})()

    def train_step(self, batch: TrainBatch) -> dict:
        self.calls.append(["train_step", batch.num_groups, batch.input_ids.tolist(),
                           batch.behaviour_logprobs.tolist(), batch.response_mask.tolist(), batch.truncated.tolist(),
                           batch.overlong_penalty.tolist(), batch.reward_failed.tolist(), batch.baseline_rows.tolist()])
        return {"loss": 0.0}

    def named_weights(self, dtype=torch.bfloat16):
        self.calls.append(["named_weights", str(dtype)])
        return []

    def capture_weights(self, dtype=torch.bfloat16):
        self.calls.append(["capture_weights", str(dtype)])
        return []

    def save_checkpoint(self, request: CheckpointRequest):
        self.calls.append(["save_checkpoint", str(request.root), request.fingerprint, request.keep_last_n])
        return request.root / "global_step_0"

    def load_checkpoint(self, path, fingerprint="", force=False):
        self.calls.append(["load_checkpoint", str(path), fingerprint, force])

    def export_hf(self, out_dir, tokenizer_dir):
        self.calls.append(["export_hf", str(out_dir), tokenizer_dir])


def batch() -> TrainBatch:
    g = torch.Generator().manual_seed(7)
    return TrainBatch(input_ids=torch.randint(0, 100, (4, 6), generator=g),
                      attention_mask=torch.ones(4, 6, dtype=torch.int64),
                      response_mask=torch.rand(4, 5, generator=g) > 0.5,
                      behaviour_logprobs=-torch.rand(4, 5, generator=g),
                      advantages=torch.randn(4, generator=g), rewards=torch.rand(4, generator=g),
                      staleness=torch.tensor([0, 1, 0, 2]), num_groups=2, group_rows=torch.tensor([[0, 1], [2, 3]]),
                      truncated=torch.tensor([False, True, False, False]),
                      overlong_penalty=torch.tensor([0.0, -1.0, -0.25, 0.0]),
                      reward_failed=torch.tensor([False, False, True, False]),
                      baseline_rows=torch.tensor([True, True, False, False]))


def both_started(folder: Path, rank: int, timeout_s: float = 120.0) -> None:
    """Mark this rank started (spawned, imports done) and poll until the other one is: the process group's
    timeout (3 s in the idle modes) then bounds the rendezvous alone, not the other process's start."""
    (folder / f"started{rank}").touch()
    deadline = time.monotonic() + timeout_s
    while not (folder / f"started{1 - rank}").exists():
        assert time.monotonic() < deadline, f"rank {1 - rank} did not start within {timeout_s} s"
        time.sleep(0.05)


def rank_main(rank: int, env: dict, out: str, mode: str) -> None:
    os.environ.update(env)  # the test process holds the rendezvous store (tests.rendezvous)
    idle = mode.startswith("idle")  # collectives time out after 3 s; rank 0 idles 7 s between two steps
    both_started(Path(out).parent, rank)
    dist.init_process_group("gloo", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=3 if idle else 1800))
    engine = RecordingEngine()
    result: dict = {}
    try:
        if rank == 0:
            if mode == "bad":
                ranks.broadcast_bytes(json.dumps({"op": "format_disk", "args": {}, "tensors": []}).encode())
            elif idle:
                leader = ranks.LeaderEngine(engine, heartbeat_s=0.5 if mode == "idle" else None)
                leader.train_step(batch())
                time.sleep(7)
                try:
                    leader.train_step(batch())
                    leader.stop_followers()
                except RuntimeError as exc:  # the follower timed out and left: the group is broken
                    result["error"] = type(exc).__name__
            else:
                leader = ranks.LeaderEngine(engine)
                leader.train_step(batch())
                leader.named_weights(torch.float32)
                leader.capture_weights()
                leader.save_checkpoint(CheckpointRequest("/ckpt", pending_lease_ids=["lease-1"], acked_lease_count=3,
                                                         fingerprint="fp", keep_last_n=2))
                leader.load_checkpoint("/ckpt/global_step_0", "fp", True)
                leader.export_hf("/export", "/tok")
                leader.stop_followers()
        else:
            try:
                result["commands"] = ranks.follow(engine)
            except ranks.RankProtocolError as exc:
                result["error"] = str(exc)
            except RuntimeError as exc:  # a collective timed out
                result["error"] = f"{type(exc).__name__}: {exc}"[:300]
    finally:
        result["calls"] = engine.calls
        Path(out).write_text(json.dumps(result))
        dist.destroy_process_group()


def run_pair(tmp_path: Path, mode: str) -> list[dict]:
    store, env = rank_store(2)
    ctx = mp.get_context("spawn")
    outs = [tmp_path / f"rank{r}.json" for r in range(2)]
    procs = [ctx.Process(target=rank_main, args=(r, env, str(outs[r]), mode)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0, f"rank exited {p.exitcode}"
    del store  # held until both ranks are done
    return [json.loads(o.read_text()) for o in outs]


def test_follower_runs_the_leaders_collective_calls_in_order(tmp_path):
    leader, follower = run_pair(tmp_path, "ok")
    assert follower["commands"] == 6
    # the follower saw the same calls with the same arguments and bit-identical batch tensors, in order;
    # lease ids stay on rank 0 (only it commits checkpoint metadata)
    assert [c[0] for c in follower["calls"]] == ["train_step", "named_weights", "capture_weights",
                                                 "save_checkpoint", "load_checkpoint", "export_hf"]
    assert follower["calls"][0] == leader["calls"][0]
    assert follower["calls"][1:] == [["named_weights", "torch.float32"], ["capture_weights", "torch.bfloat16"],
                                     ["save_checkpoint", "/ckpt", "fp", 2],
                                     ["load_checkpoint", "/ckpt/global_step_0", "fp", True],
                                     ["export_hf", "/export", "/tok"]]


def test_the_ranks_meet_though_every_released_port_is_taken(tmp_path, monkeypatch):
    # another process taking a port between "found free" and "bound by rank 0" (PortThief) would fail rank 0
    # with EADDRINUSE; the test process's store on port 0 leaves no such gap
    thief = PortThief().install(monkeypatch)
    try:
        _, follower = run_pair(tmp_path, "ok")
    finally:
        thief.release()
    assert follower["commands"] == 6


def test_an_unknown_command_is_refused_by_name(tmp_path):
    _, follower = run_pair(tmp_path, "bad")
    assert "format_disk" in follower["error"] and follower["calls"] == []


def test_the_leader_refuses_to_send_an_unknown_command():
    with pytest.raises(ValueError, match="format_disk"):
        ranks.send_command("format_disk", {})


def test_an_idle_leader_keeps_its_followers_with_pings(tmp_path):
    leader, follower = run_pair(tmp_path, "idle")
    # 7 s idle against a 3 s collective timeout: the pings (every 0.5 s) keep the follower in the group
    assert "error" not in leader and "error" not in follower, (leader, follower)
    assert follower["commands"] == 2 and [c[0] for c in follower["calls"]] == ["train_step", "train_step"]


def test_without_pings_an_idle_leader_times_its_follower_out(tmp_path):
    # the failure the heartbeat prevents (proves the test above can fail)
    _, follower = run_pair(tmp_path, "idle-no-heartbeat")
    assert "error" in follower and [c[0] for c in follower["calls"]] == ["train_step"]
