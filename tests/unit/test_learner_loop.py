import pytest
import torch

from learner.config import LearnerConfig
from learner.loop import LearnerLoop, LearnerLoopConfig, NoDataError
from learner.publisher import WeightPublisher
from replay.buffer import TrajectoryBuffer
from replay.config import ReplayConfig
from tests.fakes import FakeReplay, group_table
from tests.tiny_model import SMOLLM2_DIR


class FakeLearnerEngine:
    def __init__(self):
        self.version, self.batches = 0, []

    def train_step(self, batch):
        self.batches.append(batch)
        self.version += 1
        return {"loss": 0.5, "reward_mean": float(batch.rewards.mean())}

    def named_weights(self):
        return [("w", torch.full((4,), float(self.version)))]


def make_loop(buf, **kw):
    cfg = LearnerLoopConfig(engine=LearnerConfig(model=str(SMOLLM2_DIR)), groups_per_step=2, **kw)
    pub = WeightPublisher()
    loop = LearnerLoop(cfg, FakeLearnerEngine(), FakeReplay(buf), pub, pad_token_id=0)
    return loop, pub


def test_step_trains_publishes_next_version_and_acks():
    buf = TrajectoryBuffer(ReplayConfig())
    for i in range(4):
        buf.insert(group_table(i, rewards=[0.0, 1.0, 1.0, 0.0]))
    loop, pub = make_loop(buf)
    loop.publish_current()
    assert pub.version == 0
    row = loop.step()
    assert (row["step"], row["version"], row["trajectories"]) == (1, 1, 8)
    assert pub.version == 1 and pub.wait_newer(0, 0)[1][0].data == torch.full((4,), 1.0).numpy().tobytes()
    assert buf.info()["acked_groups_total"] == 2 and buf.info()["leased_groups"] == 0
    loop.step()
    assert pub.version == 2 and buf.info()["acked_groups_total"] == 4


def test_no_batch_within_timeout_is_a_clear_error():
    loop, _ = make_loop(TrajectoryBuffer(ReplayConfig()), sample_timeout_s=0.3)
    with pytest.raises(NoDataError, match="no batch of 2 groups within 0.3s at learner version 0"):
        loop.step()
