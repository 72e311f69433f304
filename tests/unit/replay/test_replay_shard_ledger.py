"""One replay shard (``ReplayConfig.shards``/``shard``): its ledger hands out, completes and persists only the prompt
indices ``i mod shards == shard``, its work budget is its share of the fleet's, and it refuses a group of another
shard's prompt. Without sharding every index is owned, as before."""

import pytest
from pydantic import ValidationError

from gyre.proto.trajectory import SchemaError
from gyre.replay.buffer import TrajectoryBuffer
from gyre.replay.config import ReplayConfig
from gyre.replay.ledger import PromptLedger
from tests.fakes import group_table


def test_a_shard_ledger_hands_out_its_own_indices_and_keeps_a_watermark_over_them():
    ledger = PromptLedger(num_prompts=10, clock=lambda: 0.0, shard=1, shards=3)
    assert ledger.lease("r", 10, ttl_s=5) == [(1, 0), (4, 0), (7, 0)]  # 10 prompts: shard 1 owns 1, 4, 7
    assert ledger.lease("r", 1, ttl_s=5) == []
    assert ledger.complete_many([4, 1]) == [True, True] and ledger.num_completed == 2
    assert ledger.state_dict()["done_below"] == 7 and ledger.state_dict()["done_above"] == []  # the watermark moved
    assert ledger.is_complete(4) and not ledger.is_complete(7)
    assert ledger.expire(now=6.0) == [(7, 1)] and ledger.lease("r", 3, ttl_s=5, now=6.0) == [(7, 1)]
    again = PromptLedger(num_prompts=10, clock=lambda: 0.0, shard=1, shards=3)
    again.load_state_dict(ledger.state_dict())
    assert again.num_completed == 2 and again.complete(7) and again.num_completed == 3
    whole = PromptLedger(num_prompts=3, clock=lambda: 0.0)  # unsharded: every index, as before
    assert whole.lease("r", 5, ttl_s=5) == [(0, 0), (1, 0), (2, 0)]
    with pytest.raises(ValueError, match="shard 3 of 3"):
        PromptLedger(shard=3, shards=3)


def test_a_shard_config_splits_the_work_budget_and_checks_its_index():
    assert ReplayConfig(groups_per_step=8, max_staleness=2, shards=3).work_budget == 6  # ceil(16 / 3)
    assert ReplayConfig(groups_per_step=8, max_staleness=2).work_budget == 16
    with pytest.raises(ValidationError, match=r"replay.shard \(2\) must be below replay.shards \(2\)"):
        ReplayConfig(shards=2, shard=2)


def test_a_shard_refuses_a_group_of_another_shards_prompt_and_stores_nothing(tmp_path):
    buf = TrajectoryBuffer(ReplayConfig(shards=2, shard=0, dir=str(tmp_path)))
    try:
        assert buf.lease_prompts("r", 2) == [(0, 0), (2, 0)]
        assert buf.insert(group_table(2)).accepted == 4
        with pytest.raises(SchemaError, match="prompt_index 3 belongs to replay shard 1 of 2, not to this shard"):
            buf.insert(group_table(3))
        assert buf.insert_batch([(group_table(5), b"x"), (group_table(4), b"y")]) is None  # one by one instead
        assert buf.info()["stored_groups"] == 1 and buf.info()["prompts_completed"] == 1
    finally:
        buf.close()
