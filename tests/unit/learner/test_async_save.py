"""learner.async_save without DeepSpeed: what a snapshot copies, and the writer thread's priority."""

from __future__ import annotations

import os
import threading
from collections import OrderedDict

import torch

from gyre.learner.checkpoint.async_save import BackgroundSaver, snapshot


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
