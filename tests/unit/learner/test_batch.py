"""build_train_batch: padding, shifted alignment of masks/logprobs, per-group advantages, staleness."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gyre.learner.batch import build_train_batch
from gyre.learner.config import AlgorithmConfig
from gyre.proto.trajectory import Trajectory, make_ids, to_table

PAD = 0
CFG = AlgorithmConfig()


def _traj(prompt_index, sample_index, prompt, response, reward, versions=(3,)) -> Trajectory:
    tid, gid = make_ids(prompt_index, sample_index, 0)
    return Trajectory(
        trajectory_id=tid,
        group_id=gid,
        prompt_index=prompt_index,
        sample_index=sample_index,
        attempt=0,
        task="t",
        prompt_token_ids=list(prompt),
        response_token_ids=list(response),
        # a distinct, recognisable logprob per response token: -(token id) / 100
        behaviour_logprobs=[-t / 100 for t in response],
        reward=reward,
        finish_reason="stop",
        version_span_starts=[0, 1][: len(versions)],
        version_span_versions=list(versions),
        reward_fn_version="v1",
        rollout_id="r0",
        created_at=0.0,
    )


def _rows():
    # group "7-0": prompt of 3 tokens; group "9-0": prompt of 2 tokens. Rows interleave the groups.
    return [
        _traj(7, 0, [11, 12, 13], [101, 102], 1.0),
        _traj(9, 0, [21, 22], [201, 202, 203, 204], 0.0, versions=(1, 2)),
        _traj(7, 1, [11, 12, 13], [111], 0.0),
        _traj(9, 1, [21, 22], [211], 0.0, versions=(2,)),
    ]


def test_padding_and_shifted_alignment():
    rows = _rows()
    batch = build_train_batch(to_table(rows), pad_token_id=PAD, learner_version=4, cfg=CFG)
    # longest row: 2 + 4 = 6 tokens -> L = 6, logprob axis L - 1 = 5
    assert batch.input_ids.shape == (4, 6) and batch.input_ids.dtype == torch.int64
    assert batch.response_mask.shape == batch.behaviour_logprobs.shape == (4, 5)
    assert batch.input_ids[0].tolist() == [11, 12, 13, 101, 102, PAD]
    assert batch.attention_mask[0].tolist() == [1, 1, 1, 1, 1, 0]
    assert batch.input_ids[3].tolist() == [21, 22, 211, PAD, PAD, PAD]
    # row 0 (P = 3): response tokens at input positions 3, 4 are scored at logprob indices 2, 3.
    assert batch.response_mask[0].tolist() == [False, False, True, True, False]
    for b, traj in enumerate(rows):
        idx = batch.response_mask[b].nonzero().flatten()
        scored = batch.input_ids[b, idx + 1]  # index j scores input_ids[j + 1]
        assert scored.tolist() == traj.response_token_ids
        assert batch.behaviour_logprobs[b, idx].tolist() == pytest.approx(traj.behaviour_logprobs)
        assert batch.behaviour_logprobs[b][~batch.response_mask[b]].eq(0).all()
    assert batch.num_response_tokens == 2 + 4 + 1 + 1


def test_advantages_per_group_and_staleness():
    batch = build_train_batch(to_table(_rows()), pad_token_id=PAD, learner_version=4, cfg=CFG)
    # group 7-0 rewards (1, 0): mean 0.5, population std 0.5 -> (+1, -1); group 9-0 (0, 0) -> (0, 0).
    torch.testing.assert_close(batch.advantages, torch.tensor([1.0, 0.0, -1.0, 0.0]), atol=1e-5, rtol=0)
    assert batch.num_groups == 2
    assert batch.rewards.tolist() == [1.0, 0.0, 0.0, 0.0]
    # staleness = 4 - first span version: 4 - 3, 4 - 1, 4 - 3, 4 - 2
    assert batch.staleness.tolist() == [1, 3, 1, 2]


def test_ragged_group_is_rejected_by_name():
    rows = _rows()[:3]  # group 9-0 keeps only one of its two rows
    with pytest.raises(ValueError, match="group '9-0' has 1 rows"):
        build_train_batch(to_table(rows), pad_token_id=PAD, learner_version=4, cfg=CFG)


def test_inconsistent_groups_are_rejected_by_name():
    rows = _rows()
    rows[2] = dataclasses.replace(rows[2], prompt_token_ids=[11, 12, 99])
    with pytest.raises(ValueError, match="group '7-0' mixes different prompt_token_ids"):
        build_train_batch(to_table(rows), pad_token_id=PAD, learner_version=4, cfg=CFG)
    rows = _rows()
    rows[3] = dataclasses.replace(rows[3], sample_index=0, trajectory_id="9-0-0b")
    with pytest.raises(ValueError, match="group '9-0' repeats a sample_index"):
        build_train_batch(to_table(rows), pad_token_id=PAD, learner_version=4, cfg=CFG)


def test_empty_prompt_is_rejected():
    rows = [_traj(1, 0, [], [5], 1.0), _traj(1, 1, [], [6], 0.0)]
    with pytest.raises(ValueError, match="empty prompt"):
        build_train_batch(to_table(rows), pad_token_id=PAD, learner_version=0, cfg=CFG)


@pytest.mark.parametrize(
    ("advantage", "expected"),
    [
        # rows: (group 7-0, r 1), (9-0, r 0), (7-0, r 0), (9-0, r 0); group 9-0 is constant -> 0 everywhere
        ("grpo", [1.0, 0.0, -1.0, 0.0]),  # (1, 0): mean 0.5, std 0.5
        ("dr_grpo", [0.5, 0.0, -0.5, 0.0]),  # no std division
        ("rloo", [1.0, 0.0, -1.0, 0.0]),  # 1 - 0 and 0 - 1
        # centred (0.5, 0, -0.5, 0), whitened over response tokens (lengths 2, 4, 1, 1; OpenRLHF): mean
        # (1 - 0.5) / 8 = 0.0625, var (2 * 0.4375^2 + 4 * 0.0625^2 + 0.5625^2 + 0.0625^2) / 8 = 0.08984375
        # (per row it would be +-1.414214, 0)
        ("reinforce_pp", [1.459601, -0.208514, -1.876630, -0.208514]),
        ("gae", [0.0, 0.0, 0.0, 0.0]),  # computed in the engine from the critic's values
    ],
)
def test_advantage_estimator_is_picked_from_config(advantage, expected):
    cfg = AlgorithmConfig(advantage=advantage, max_response_tokens=8)
    batch = build_train_batch(to_table(_rows()), pad_token_id=PAD, learner_version=4, cfg=cfg)
    torch.testing.assert_close(batch.advantages, torch.tensor(expected), atol=1e-5, rtol=0)


def test_rloo_rejects_single_sample_groups():
    rows = [_traj(1, 0, [5], [6], 1.0), _traj(2, 0, [5], [7], 0.0)]
    with pytest.raises(ValueError, match="group size 1"):
        build_train_batch(to_table(rows), pad_token_id=PAD, learner_version=0, cfg=AlgorithmConfig(advantage="rloo"))


def test_environment_tokens_are_read_but_never_trained_and_broken_episodes_leave_the_batch():
    """A multi-turn row: model 2, observation 2 (mask 0), model 1. The observation stays in the input (the model
    reads it) but leaves the response mask, its behaviour logprobs are 0, and dr_grpo's length is 3, not 5."""
    ep = dataclasses.replace(_traj(7, 0, [11, 12, 13], [101, 102, 50, 51, 103], 1.0),
                             behaviour_logprobs=[-1.01, -1.02, -9.0, -9.0, -1.03], loss_mask=[1, 1, 0, 0, 1],
                             turn_starts=[0, 4], tool_calls=1, episode_end="done")
    broken = dataclasses.replace(_traj(7, 1, [11, 12, 13], [111, 60], 0.0), loss_mask=[1, 0],
                                 reward_error="episode-env_error: step raised ValueError: x")
    other = _traj(7, 2, [11, 12, 13], [121], 0.0)
    batch = build_train_batch(to_table([ep, broken, other]), pad_token_id=PAD, learner_version=4, cfg=CFG)
    assert batch.input_ids[0].tolist() == [11, 12, 13, 101, 102, 50, 51, 103]
    assert batch.response_mask[0].tolist() == [False, False, True, True, False, False, True]
    assert batch.behaviour_logprobs[0].tolist() == pytest.approx([0, 0, -1.01, -1.02, 0, 0, -1.03])
    assert not batch.response_mask[1].any() and not batch.baseline_rows[1]  # the broken episode: nothing
    assert batch.num_response_tokens == 3 + 1
    assert batch.advantages[0] > 0 > batch.advantages[2]  # the baseline is the two scored rows'
    assert batch.episodes == pytest.approx({"episode_turns_mean": 1.5, "tool_calls_mean": 0.5, "tool_error_frac": 0.0,
                                            "episode_broken_frac": 0.5, "episode_max_turns_frac": 0.0,
                                            "env_token_frac": 3 / 7})
    assert build_train_batch(to_table(_rows()), pad_token_id=PAD, learner_version=4, cfg=CFG).episodes == {}
