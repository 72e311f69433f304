"""A refused NCCL version is not asked for again: its bytes went by in the one broadcast this rank joined.

Before the fix, the transport re-subscribed after a refusal, was handed the same manifest, joined a broadcast
the learner never repeats, paired the *next* version's bytes with the old manifest (refused again) and then
waited for a broadcast that never came: it never delivered again. gloo on CPU stands in for NCCL.
"""

import time

import torch

from services.weight_transport.nccl import NcclWeightSender, torch_distributed_broadcast
from tests.unit.test_weight_transport import _GlooPair, _nccl_rollout, _wait, learner, named  # noqa: F401


def test_refused_version_is_skipped_not_retried_and_the_next_one_lands(learner):  # noqa: F811
    pub, address = learner
    pair, got = _GlooPair(), []
    transport = _nccl_rollout(address, pair.groups[1], got, have_version=2).start()
    clean = torch_distributed_broadcast(pair.groups[0])

    def corrupting(t, src):
        if t.shape == (7,):
            t = t.clone()
            t.view(torch.int32)[0] ^= 1
        clean(t, src)
    NcclWeightSender(pub, corrupting).send(3, named(3))
    _wait(lambda: transport.errors == 1)
    time.sleep(1.0)  # 10× the backoff: a retrying transport would now sit in a broadcast for version 3
    NcclWeightSender(pub, clean).send(4, named(4))
    _wait(lambda: transport.delivered_version == 4)
    assert transport.errors == 1 and [v for v, _ in got] == [4]
    for (n1, t1), (n2, t2) in zip(named(4), got[0][1]):
        assert n1 == n2 and torch.equal(t1, t2)
    NcclWeightSender(pub, clean).send(5, named(5))
    _wait(lambda: transport.delivered_version == 5)
    assert transport.errors == 1
    transport.stop()
