"""Publishing behind the learner's steps: a step waits for the capture only; the newest capture wins; a failed
background publish stops the next step; lockstep still waits; the ZeRO-3 capture keeps one copy, on rank 0."""

from __future__ import annotations

import threading

import pytest
import torch

from gyre.learner.background_publish import BackgroundPublisher
from gyre.learner.publisher import WeightPublisher
from gyre.learner.versions import StreamedPublishing
from gyre.learner.weight_capture import buckets
from tests.unit.learner.test_learner_loop import filled_buffer, make_loop


class GatedVersions(StreamedPublishing):
    """``published`` (the first thing a background publish does with a version) waits for ``gate``."""

    def __init__(self):
        super().__init__()
        self.gate, self.entered, self.seen = threading.Event(), threading.Event(), []

    def published(self, version, named):
        self.entered.set()
        assert self.gate.wait(30), "gate never opened"
        self.seen.append((version, named[0][1].clone()))


def test_a_step_returns_while_its_version_is_still_being_published():
    """Before, ``publish_current`` copied and encoded inside the step: this step could not return before the gate
    opened (the test then times out in ``step``)."""
    loop, pub = make_loop(filled_buffer(), save_interval=100)
    loop.versions = loop.background.versions = GatedVersions()
    loop.versions.gate.set()
    loop.publish_current()
    loop.versions.gate.clear()
    done = threading.Event()
    worker = threading.Thread(target=lambda: (loop.step(), done.set()), daemon=True)
    worker.start()
    assert done.wait(30), "the step waited for the background publish"
    assert loop.versions.entered.wait(30) and pub.version == 0  # version 1 captured, not yet served
    loop.engine.version = 99  # the learner moves on: the captured copy is what goes out
    loop.versions.gate.set()
    loop.background.flush(30)
    assert pub.version == 1 and bytes(pub.wait_newer(0, 0)[1][0].data) == torch.full((4,), 1.0).numpy().tobytes()


def test_the_newest_capture_replaces_a_waiting_one_and_memory_stays_bounded():
    versions = GatedVersions()
    publisher = WeightPublisher()
    bg = BackgroundPublisher(publisher, versions)
    bg.submit(1, 0, [("w", torch.full((2,), 1.0))])
    assert versions.entered.wait(30)  # version 1 in flight, blocked
    bg.submit(2, 0, [("w", torch.full((2,), 2.0))])  # waits
    bg.submit(3, 0, [("w", torch.full((2,), 3.0))])  # replaces 2
    versions.gate.set()
    bg.flush(30)
    assert [v for v, _ in versions.seen] == [1, 3] and bg.superseded == 1
    assert publisher.version == 3 and bg.last_background_s > 0
    bg.close()


def test_a_failed_background_publish_stops_the_next_step():
    loop, pub = make_loop(filled_buffer(), save_interval=100)
    loop.publish_current()
    pub.publish(5, [("w", torch.zeros(4))])  # someone else published a newer version: version 1 is refused
    loop.step()  # its publish fails in the background
    with pytest.raises(ValueError, match="version 1 is not newer than published version 5"):
        loop.background.flush(30)
    with pytest.raises(ValueError, match="not newer"):
        loop.step()  # and the learner does not train on past it


def test_lockstep_publishing_waits_inside_the_step(tmp_path):
    """Lockstep's version store must have version s before step s returns (a mismatch stops that step)."""
    from gyre.learner.versions import LockstepPublishing
    from gyre.proto.lockstep import LockstepConfig

    assert LockstepPublishing.publish_in_background is False and StreamedPublishing.publish_in_background is True
    loop, pub = make_loop(filled_buffer(), save_interval=100,
                          lockstep=LockstepConfig(weights_dir=str(tmp_path / "w"), lag=1, groups_per_step=2))
    loop.publish_current(wait=False)
    assert pub.version == 0  # waited although asked not to


def test_buckets_cover_every_parameter_in_order_within_the_budget():
    params = [(f"p{i}", torch.nn.Parameter(torch.zeros(n))) for i, n in enumerate([10, 30, 5, 100, 1, 1])]
    got = buckets(params, bucket_bytes=80, itemsize=2)
    assert [[n for n, _ in b] for b in got] == [["p0", "p1"], ["p2"], ["p3"], ["p4", "p5"]]
    with pytest.raises(ValueError, match="bucket_bytes"):
        buckets(params, 0, 2)
