"""learner.async_save without DeepSpeed: what a snapshot copies, the writer thread's priority, and the shard
markers through which the ranks of an asynchronous multi-rank save meet before rank 0 commits."""

from __future__ import annotations

import os
import threading
from collections import OrderedDict

import pytest
import torch

from gyre.learner.checkpoint.async_save import (BackgroundSaver, ShardWaitError, mark_shard, snapshot,
                                                wait_for_shards)


def test_snapshot_copies_tensors_and_rebuilds_containers():
    weight = torch.arange(12.0).reshape(3, 4)
    state = {"module": OrderedDict(w=weight, view=weight[:, 1]), "optim": [{"exp_avg": weight * 2}], "step": 7,
             "betas": (0.9, 0.99)}
    snap = snapshot(state)
    weight.add_(100.0)  # training goes on after the capture
    state["optim"][0]["exp_avg"].zero_()
    assert torch.equal(snap["module"]["w"], torch.arange(12.0).reshape(3, 4))
    assert isinstance(snap["module"], OrderedDict) and list(snap["module"]) == ["w", "view"]
    view = snap["module"]["view"]
    assert view.is_contiguous() and view.untyped_storage().nbytes() == 3 * 4  # compact, not the whole storage
    assert torch.equal(snap["optim"][0]["exp_avg"], torch.arange(12.0).reshape(3, 4) * 2)
    assert snap["step"] == 7 and snap["betas"] == (0.9, 0.99)


def test_writer_thread_runs_at_the_lowest_priority_and_one_save_at_a_time():
    saver = BackgroundSaver()
    gate, order = threading.Event(), []

    def first():
        gate.wait(5)
        order.append("first")
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    f1 = saver.submit(first)
    threading.Timer(0.2, gate.set).start()
    f2 = saver.submit(lambda: order.append("second"))  # waits for the first
    f2.result(5)
    assert f1.result() == 19 and order == ["first", "second"]
    saver.shutdown()


def _shard(tmp, rank: int) -> list:
    path = tmp / "deepspeed" / f"zero_pp_rank_{rank}_optim_states.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * (10 + rank))
    return [path]


def test_rank0_waits_for_every_other_ranks_marker_then_removes_them(tmp_path):
    marked = []

    def rank(r: int, delay: float) -> None:
        threading.Event().wait(delay)
        mark_shard(tmp_path, r, _shard(tmp_path, r))
        marked.append(r)

    threads = [threading.Thread(target=rank, args=(r, 0.1 * r)) for r in (1, 2, 3)]
    for t in threads:
        t.start()
    wait_for_shards(tmp_path, world_size=4, timeout_s=30, poll_s=0.01)
    assert sorted(marked) == [1, 2, 3]  # returned only after the last (slowest) rank marked its shard
    assert not list(tmp_path.glob(".shard_rank*"))  # markers are not part of the committed checkpoint
    assert len(list(tmp_path.rglob("*.pt"))) == 3
    wait_for_shards(tmp_path, world_size=1, timeout_s=0)  # a world of one waits for nobody


def test_a_missing_marker_times_out_naming_the_rank(tmp_path):
    mark_shard(tmp_path, 1, _shard(tmp_path, 1))
    with pytest.raises(ShardWaitError, match=r"rank\(s\) \[2\] did not finish writing their shard within 0.2 s"):
        wait_for_shards(tmp_path, world_size=3, timeout_s=0.2, poll_s=0.01)


def test_a_failed_write_and_a_short_file_are_reported_by_rank(tmp_path):
    mark_shard(tmp_path, 1, [], error=OSError(28, "No space left on device"))
    with pytest.raises(ShardWaitError, match=r"rank 1 failed to write its shard: OSError: .*No space left"):
        wait_for_shards(tmp_path, world_size=2, timeout_s=5)
    files = _shard(tmp_path, 1)
    mark_shard(tmp_path, 1, files)
    files[0].write_bytes(b"x")  # truncated after it was marked (or not yet visible in full on a shared FS)
    with pytest.raises(ShardWaitError, match=r"rank 1 wrote deepspeed/zero_pp_rank_1_optim_states.pt \(11 bytes\) "
                                             r"but it is 1 bytes"):
        wait_for_shards(tmp_path, world_size=2, timeout_s=5)
