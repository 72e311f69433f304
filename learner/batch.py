"""Arrow trajectory table → padded tensors the learner trains on (``TrainBatch``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pyarrow as pa
import torch

from gyre.learner.algo.advantages import group_advantages, masked_group_advantages, overlong_penalty
from gyre.learner.config import AlgorithmConfig
from gyre.learner.algo.objectives import AdvantageInputs, custom_advantages
from gyre.proto.trajectory import validate_table


@dataclass(frozen=True)
class TrainBatch:
    """One learner batch: whole GRPO groups, prompt+response concatenated and right-padded.

    ``B`` = rows, ``L`` = longest ``P + T`` in the batch. Logprob-shaped fields are ``[B, L - 1]`` and
    aligned with ``algorithms.token_logprobs``: index ``j`` scores token ``input_ids[:, j + 1]``, so
    response token ``k`` of a row with prompt length ``P`` sits at index ``P - 1 + k``.
    """

    input_ids: torch.Tensor
    """[B, L] int64: prompt then response tokens, right-padded with ``pad_token_id``."""

    attention_mask: torch.Tensor
    """[B, L] int64: 1 on real tokens, 0 on padding."""

    response_mask: torch.Tensor
    """[B, L - 1] bool: True where index ``j`` scores a response token (the loss's valid tokens); all False
    for a truncated row under ``AlgorithmConfig.overlong_filter``."""

    behaviour_logprobs: torch.Tensor
    """[B, L - 1] float32: rollout logprob of the token scored at ``j``; 0 where ``response_mask`` is False."""

    advantages: torch.Tensor
    """[B] float32: outcome advantage of each row (``AlgorithmConfig.advantage``) of its ``shaped_rewards``,
    computed within its group (``reinforce_pp`` also whitens over the batch's response tokens); all 0 for
    ``gae``, whose per-token advantages need the critic's values and are computed in ``learner.engine``. A custom
    estimator (``learner.objectives``) may return ``[B, L - 1]`` per-token advantages instead."""

    rewards: torch.Tensor
    """[B] float32: raw verifier rewards (for metrics; ``shaped_rewards`` is what the advantages see)."""

    staleness: torch.Tensor
    """[B] int64: ``learner_version - oldest span version`` of each row (policy lag, >= 0 normally)."""

    num_groups: int
    """Number of distinct ``group_id`` values (G); ``B = G * n``."""

    group_rows: torch.Tensor
    """[G, n] int64: the row indices of each group (first-appearance order), for advantages that are
    recomputed from per-token rewards in ``learner.engine`` (``kl_placement: reward``)."""

    truncated: torch.Tensor
    """[B] bool: the row's ``finish_reason`` is ``"length"`` (the rollout cut it at ``max_new_tokens``)."""

    overlong_penalty: torch.Tensor
    """[B] float32: DAPO's soft overlong punishment of the row (``learner.algo.advantages.overlong_penalty``,
    ``<= 0``); all 0 when ``AlgorithmConfig.overlong_buffer_len`` is 0."""

    reward_failed: torch.Tensor
    """[B] bool: the row's ``reward_error`` is set (its reward 0.0 is no verdict)."""

    baseline_rows: torch.Tensor
    """[B] bool: the rows that trained and formed their group's baseline (``AlgorithmConfig.failed_scores``);
    all True when no score failed. Rows outside it have no response tokens."""

    episodes: dict[str, float] = field(default_factory=dict)
    """Multi-turn metrics of the batch (``episode_metrics``); empty when no row is an episode."""

    @property
    def shaped_rewards(self) -> torch.Tensor:
        """[B] float32: ``rewards + overlong_penalty``, the outcome rewards the advantages are computed from."""
        return self.rewards + self.overlong_penalty

    @property
    def batch_size(self) -> int:
        """Number of rows B."""
        return int(self.input_ids.shape[0])

    @property
    def num_response_tokens(self) -> int:
        """Valid (loss) tokens in the whole batch: the token-mean normaliser."""
        return int(self.response_mask.sum())


def build_train_batch(
    table: pa.Table, pad_token_id: int, learner_version: int, cfg: AlgorithmConfig
) -> TrainBatch:
    """Pad a table of whole groups into a ``TrainBatch`` with the configured outcome advantages.

    Rows keep the table's order; groups are the rows sharing ``group_id`` (need not be contiguous).

    Args:
        table: trajectory rows (``proto.trajectory.TRAJECTORY_SCHEMA``), validated here.
        pad_token_id: token id used for right padding (masked out everywhere).
        learner_version: the learner's current policy version, for staleness.
        cfg: ``advantage`` (``gae`` leaves ``advantages`` at 0), ``adv_eps``; ``overlong_buffer_len`` (DAPO's
            soft penalty, added to the rewards before the advantages) and ``overlong_filter`` (``"length"``
            rows get no response tokens and 0 behaviour logprobs, after the advantages); ``failed_scores``
            (rows with a ``reward_error`` leave the loss and the baselines, ``scored_rows``); a custom ``advantage``
            is called on the padded rows (``learner.objectives.custom_advantages``).

    Raises:
        proto.trajectory.SchemaError: the table does not match the schema.
        ValueError: empty table; a row with an empty prompt; a group whose size differs from the
            first group's (ragged), whose rows disagree on the prompt tokens, or repeat a
            ``sample_index`` — the message names the group; an outcome estimator (``grpo``, ``dr_grpo``,
            ``rloo``, ``reinforce_pp``) with groups of one sample.
        learner.objectives.ObjectiveError: a custom advantage that fails or returns a wrong tensor.
    """
    validate_table(table)
    if table.num_rows == 0:
        raise ValueError("trajectory table is empty")
    cols = {
        name: table.column(name).to_pylist()
        for name in (
            "group_id",
            "sample_index",
            "prompt_token_ids",
            "response_token_ids",
            "behaviour_logprobs",
            "reward",
            "version_span_versions",
            "finish_reason",
            "reward_error",
            "loss_mask",
            "turn_starts",
            "tool_calls",
            "tool_errors",
            "episode_end",
        )
    }
    groups = _group_rows(cols["group_id"], cols["sample_index"], cols["prompt_token_ids"])
    rewards = torch.tensor(cols["reward"], dtype=torch.float32)
    truncated, penalty = _overlong(cols["finish_reason"], cols["loss_mask"], cols["turn_starts"], cfg)
    row_index = torch.tensor([rows for rows in groups.values()], dtype=torch.int64)  # [G, n]
    failed = torch.tensor([bool(err) for err in cols["reward_error"]], dtype=torch.bool)
    filtered = truncated if cfg.overlong_filter else torch.zeros_like(truncated)  # out of the loss (DAPO)
    # the tokens each row trains (the policy's own, none for a filtered row): reinforce_pp whitens over these
    lengths = torch.tensor([sum(m) for m in cols["loss_mask"]], dtype=torch.int64).masked_fill(filtered, 0)
    if cfg.custom_advantage:  # computed below, from the padded rows (``learner.objectives``)
        advantages, baseline = None, scored_rows(cfg, failed, row_index)
    else:
        advantages, baseline = _advantages(cfg, rewards + penalty, row_index, failed, lengths)
    input_ids, attention_mask, response_mask, behaviour = _pad_rows(
        cols["prompt_token_ids"], cols["response_token_ids"], cols["behaviour_logprobs"], pad_token_id,
        cols["loss_mask"])
    # out of the loss: truncated rows (DAPO's overlong filtering; still in the baselines above) and rows whose
    # score failed (out of the baselines too)
    dropped = filtered | ~baseline
    response_mask[dropped] = False
    behaviour[dropped] = 0.0
    staleness = torch.tensor(
        [learner_version - spans[0] for spans in cols["version_span_versions"]], dtype=torch.int64
    )
    if advantages is None:
        advantages = custom_advantages(AdvantageInputs(rewards + penalty, row_index, baseline, response_mask,
                                                       behaviour, staleness, cfg))
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        response_mask=response_mask,
        behaviour_logprobs=behaviour,
        advantages=advantages,
        rewards=rewards,
        staleness=staleness,
        num_groups=len(groups),
        group_rows=row_index,
        truncated=truncated,
        overlong_penalty=penalty,
        reward_failed=failed,
        baseline_rows=baseline,
        episodes=episode_metrics(cols),
    )


def episode_metrics(cols: dict[str, list]) -> dict[str, float]:
    """Per-episode metrics over a batch's multi-turn rows (``episode_end`` set, or a broken episode's
    ``"episode-"`` reward error); ``{}`` when there are none. ``episode_turns_mean``: model turns per episode;
    ``tool_calls_mean``: tool calls per episode; ``tool_error_frac``: failed calls ÷ calls (0 without calls);
    ``episode_broken_frac``: episodes that broke (environment error, time budget; not trained on);
    ``episode_max_turns_frac``: episodes cut at ``max_turns``; ``env_token_frac``: the episodes' response tokens
    written by the environment (loss mask 0) ÷ all their response tokens."""
    rows = [i for i, (end, err) in enumerate(zip(cols["episode_end"], cols["reward_error"]))
            if end or err.startswith("episode-")]
    if not rows:
        return {}
    n = len(rows)
    calls = sum(cols["tool_calls"][i] for i in rows)
    tokens = sum(len(cols["loss_mask"][i]) for i in rows)
    return {"episode_turns_mean": sum(len(cols["turn_starts"][i]) for i in rows) / n,
            "tool_calls_mean": calls / n,
            "tool_error_frac": sum(cols["tool_errors"][i] for i in rows) / calls if calls else 0.0,
            "episode_broken_frac": sum(cols["reward_error"][i].startswith("episode-") for i in rows) / n,
            "episode_max_turns_frac": sum(cols["episode_end"][i] == "max_turns" for i in rows) / n,
            "env_token_frac": (tokens - sum(sum(cols["loss_mask"][i]) for i in rows)) / tokens if tokens else 0.0}


def scored_rows(cfg: AlgorithmConfig, failed: torch.Tensor, group_rows: torch.Tensor) -> torch.Tensor:
    """``[B]`` bool, the rows that may form baselines and train under ``cfg.failed_scores``: every row whose
    score did not fail (``mask_rows``), or only the rows of groups without a failed row (``drop_groups``)."""
    valid = ~failed
    if cfg.failed_scores == "drop_groups":
        whole = valid[group_rows].all(dim=1, keepdim=True).expand_as(group_rows)  # [G, n]
        valid = torch.zeros_like(valid)
        valid[group_rows.flatten()] = whole.flatten()
    return valid


def _advantages(cfg: AlgorithmConfig, returns: torch.Tensor, group_rows: torch.Tensor, failed: torch.Tensor,
                lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(advantages [B], baseline rows [B] bool)`` of the batch's outcome returns; ``gae`` leaves the advantages
    at 0 (the engine computes them) and only drops the rows ``scored_rows`` excludes."""
    valid = scored_rows(cfg, failed, group_rows)
    if cfg.advantage == "gae":
        return torch.zeros_like(returns), valid
    if bool(valid.all()):
        return group_advantages(cfg.advantage, returns, group_rows, cfg.adv_eps, lengths), valid
    return masked_group_advantages(cfg.advantage, returns, group_rows, cfg.adv_eps, valid, lengths)


def reward_error_metrics(batch: TrainBatch) -> dict[str, float]:
    """``reward_error_frac``: the fraction of the batch's rows whose score failed; ``reward_error_untrained_frac``:
    the fraction left out of the loss and the baselines for it (failed rows, their groups under
    ``drop_groups``, and groups left without a baseline)."""
    return {"reward_error_frac": float(batch.reward_failed.float().mean()),
            "reward_error_untrained_frac": float((~batch.baseline_rows).float().mean())}


def _overlong(finish_reasons: list[str], loss_masks: list[list[int]], turn_starts: list[list[int]],
              cfg: AlgorithmConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """``(truncated [B] bool: finish reason "length", overlong_penalty [B] float32)``; the penalty is all 0
    unless ``cfg.overlong_buffer_len > 0``. ``max_response_tokens`` is a budget per model turn
    (``max_new_tokens``), so DAPO's ``|y|`` is the row's longest model turn (``longest_turn``): a multi-turn
    episode's observation tokens and its other turns do not count against one turn's budget."""
    truncated = torch.tensor([reason == "length" for reason in finish_reasons], dtype=torch.bool)
    if cfg.overlong_buffer_len == 0:
        return truncated, torch.zeros(len(loss_masks), dtype=torch.float32)
    lengths = torch.tensor([longest_turn(m, t) for m, t in zip(loss_masks, turn_starts, strict=True)],
                           dtype=torch.int64)
    penalty = overlong_penalty(lengths, cfg.max_response_tokens, cfg.overlong_buffer_len, cfg.overlong_penalty_factor)
    return truncated, penalty


def longest_turn(loss_mask: list[int], turn_starts: list[int]) -> int:
    """Model tokens (``loss_mask`` 1) of a row's longest turn; ``turn_starts`` ``[K]`` are the turns' offsets in the
    response (``[0]`` for a single-turn row, whose one turn is all its mask-1 tokens)."""
    bounds = [*turn_starts, len(loss_mask)]
    return max((sum(loss_mask[a:b]) for a, b in zip(bounds, bounds[1:])), default=0)


def truncation_metrics(batch: TrainBatch, cfg: AlgorithmConfig) -> dict[str, float]:
    """``truncated_frac``: the fraction of the batch's rows with ``finish_reason "length"``; with the soft
    overlong punishment on (``cfg.overlong_buffer_len > 0``) also ``overlong_penalty_mean``, the rows' mean
    penalty (``<= 0``; the verifier's ``reward_mean`` leaves it out)."""
    out = {"truncated_frac": float(batch.truncated.float().mean())}
    if cfg.overlong_buffer_len > 0:
        out["overlong_penalty_mean"] = float(batch.overlong_penalty.mean())
    return out


def _group_rows(group_ids: list[str], sample_indices: list[int], prompts: list[list[int]]) -> dict[str, list[int]]:
    """group_id → row indices (first-appearance order), checking every group is whole and consistent."""
    groups: dict[str, list[int]] = {}
    for row, gid in enumerate(group_ids):
        groups.setdefault(gid, []).append(row)
    size = len(next(iter(groups.values())))
    first_gid = next(iter(groups))
    for gid, rows in groups.items():
        if len(rows) != size:
            raise ValueError(
                f"group {gid!r} has {len(rows)} rows but group {first_gid!r} has {size}; "
                "a batch must hold whole groups of equal size"
            )
        samples = [sample_indices[r] for r in rows]
        if len(set(samples)) != len(samples):
            raise ValueError(f"group {gid!r} repeats a sample_index: {sorted(samples)}")
        if any(prompts[r] != prompts[rows[0]] for r in rows):
            raise ValueError(f"group {gid!r} mixes different prompt_token_ids")
    return groups


def _pad_rows(
    prompts: list[list[int]], responses: list[list[int]], logprobs: list[list[float]], pad_token_id: int,
    loss_masks: list[list[int]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad ``prompt + response`` rows; returns input_ids, attention_mask, response_mask, behaviour.

    ``loss_masks`` (``[T]`` per row, the trajectory's ``loss_mask``): a multi-turn episode's environment tokens
    (mask 0) stay in ``input_ids`` and ``attention_mask`` (the model reads them) but leave ``response_mask`` and
    get behaviour logprob 0.0, so no loss, advantage, KL or ratio metric ever counts them."""
    for row, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"row {row} has an empty prompt; the first response token needs a context")
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    bsz, seq = len(prompts), max(lengths)
    input_ids = torch.full((bsz, seq), pad_token_id, dtype=torch.int64)
    attention_mask = torch.zeros((bsz, seq), dtype=torch.int64)
    response_mask = torch.zeros((bsz, seq - 1), dtype=torch.bool)
    behaviour = torch.zeros((bsz, seq - 1), dtype=torch.float32)
    for row, (prompt, response, lp) in enumerate(zip(prompts, responses, logprobs)):
        p, t = len(prompt), len(response)
        input_ids[row, : p + t] = torch.tensor(prompt + response, dtype=torch.int64)
        attention_mask[row, : p + t] = 1
        own = torch.ones(t, dtype=torch.bool) if loss_masks is None else torch.tensor(loss_masks[row], dtype=torch.bool)
        response_mask[row, p - 1 : p - 1 + t] = own
        behaviour[row, p - 1 : p - 1 + t] = torch.tensor(lp, dtype=torch.float32) * own
    return input_ids, attention_mask, response_mask, behaviour
