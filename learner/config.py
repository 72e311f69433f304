"""Learner configuration: the RL algorithm's knobs and the DeepSpeed engine's."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from gyre.learner.algo.kl_control import KLControlConfig, check_kl_ctrl
from gyre.utils.callable_spec import CallableSpecError, resolve_file_spec, split_spec


KL_LOSS_GRADIENT: dict[str, str | None] = {"k1": None, "k2": "KL(pi || pi_ref)", "k3": "KL(pi_ref || pi)"}
"""What each ``kl_estimator`` trains as a loss: the KL whose gradient ``E_{a ~ pi}[grad k(x_a)]`` equals (per
position, the sampling distribution held fixed), or ``None`` where that expectation is 0 (``k1``). Checked
exactly in ``tests/unit/learner/test_kl_gradients.py``."""


BuiltinAdvantage = Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "gae"]
"""The built-in advantage estimators (``learner.algo.advantages``); anything else is an import path."""
BuiltinLoss = Literal["ppo_clip"]
"""The built-in policy loss (``learner.algo.losses.policy_loss``); anything else is an import path."""


class AlgorithmConfig(BaseModel):
    """The RL algorithm: advantage estimator, off-policy correction, regularisers and critic
    (see ``learner.algo.advantages`` and ``learner.algo.losses``). The defaults are GRPO advantages with the
    decoupled PPO loss (AReaL) times a token-level truncated importance weight (TIS)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    advantage: BuiltinAdvantage | str = "grpo"
    """Advantage estimator. ``grpo``: ``(r - mean_g) / (std_g + adv_eps)`` (Shao et al. 2024);
    ``dr_grpo``: ``r - mean_g`` (Liu et al. 2025; with ``loss_agg_mode: auto`` it also gets the constant
    ``seq-mean-token-sum-norm`` aggregation); ``rloo``: leave-one-out baseline ``r_i - mean_{j != i} r_j`` (Ahmadian et al.
    2024); ``reinforce_pp``: group-mean baseline, then whitened over the batch's response *tokens* (each
    row's value counted once per token, as OpenRLHF's ``reinforce_baseline`` does; REINFORCE++-baseline,
    Hu 2025); ``gae``: PPO with a value head and GAE over the response tokens (Schulman et al. 2016), the
    outcome reward sitting on the last response token. The four group baselines need groups of >= 2
    samples (a recipe with ``rollout.group_size < 2`` is refused); ``gae`` takes any group size. Or your own
    estimator as an import path ``"pkg.module:fn"`` / ``"path/to/file.py:fn"``, called as
    ``fn(AdvantageInputs) -> [B] or [B, T] float32`` (the contract: ``learner.objectives``); it is imported and
    run on a tiny synthetic batch when the recipe loads, and again on every learner rank."""

    loss: BuiltinLoss | str = "ppo_clip"
    """The policy loss. ``ppo_clip``: the PPO-clip surrogate against ``policy_ratio``'s anchor times the
    ``is_weight`` correction, with ``clip_eps_low/high`` and ``dual_clip_c`` (``learner.algo.losses.policy_loss``; verl's
    ``loss_mode: vanilla``). Or your own loss as an import path ``"pkg.module:fn"`` / ``"path/to/file.py:fn"``,
    called once per micro-batch as ``fn(LossInputs) -> loss`` or ``(loss, metrics)`` (the contract:
    ``learner.objectives``) in place of ``ppo_clip``; the KL, entropy and value terms are still added. It is
    imported and checked on a tiny synthetic batch (a scalar with a gradient to the logprobs) when the recipe
    loads, and again on every learner rank."""

    policy_ratio: Literal["proximal", "behaviour"] = "proximal"
    """What the PPO ratio ``pi / pi_anchor`` is clipped against. ``proximal``: the learner's own
    logprobs recomputed at the start of the step (decoupled PPO, AReaL, Fu et al. 2025); the
    behaviour -> proximal gap is then corrected by ``is_weight``. ``behaviour``: the rollout's (vLLM's)
    logprobs (standard PPO-clip against the behaviour policy); ``is_weight`` must then be ``none`` or a
    ``mis_*`` mask, since a truncated weight on top would correct the same gap twice."""

    is_weight: Literal["tis_token", "tis_seq", "mis_token", "mis_seq", "none"] = "tis_token"
    """Importance correction on ``rho = pi_proximal / pi_behaviour`` (detached), multiplied into each
    token's loss. ``tis_token``: ``min(rho_t, tis_cap)`` (TIS, Yao et al. 2025); ``tis_seq``:
    ``min(prod_t rho_t, tis_cap)`` over the trajectory, shared by its tokens; ``mis_token``: weight 1,
    but tokens with ``rho_t`` outside ``[mis_low, mis_high]`` are dropped from the loss (masked IS /
    "icepop"); ``mis_seq``: the same test on the trajectory's ``prod_t rho_t``, dropping whole
    trajectories; ``none``: weight 1."""

    clip_eps_low: float = Field(0.2, ge=0.0, lt=1.0)
    """PPO clip range below 1: the ratio ``pi/pi_anchor`` is clipped at ``1 - clip_eps_low``."""

    clip_eps_high: float = Field(0.2, ge=0.0)
    """PPO clip range above 1: the ratio is clipped at ``1 + clip_eps_high`` (DAPO's clip-higher
    sets this above ``clip_eps_low``, e.g. 0.28)."""

    tis_cap: float = Field(2.0, ge=1.0)
    """Truncation ``C`` of the importance weight ``min(rho, C)`` of ``tis_token`` / ``tis_seq``
    (TIS, Yao et al. 2025). ``>= 1`` so that on-policy tokens (weight 1) are never truncated."""

    mis_low: float = Field(0.5, ge=0.0, le=1.0)
    """Lower edge of the kept band of ``mis_token`` / ``mis_seq``: ratios below it are masked out.
    In ``[0, 1]`` so that on-policy tokens (ratio 1) are always kept."""

    mis_high: float = Field(2.0, ge=1.0)
    """Upper edge of the kept band of ``mis_token`` / ``mis_seq``: ratios above it are masked out."""

    loss_agg_mode: Literal["auto", "token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                           "seq-mean-token-sum-norm"] = "auto"
    """How the per-token losses of a (mini-)batch of ``B`` rows are aggregated (verl's ``loss_agg_mode``), with
    ``|o_i|`` the valid response tokens of row ``i`` and ``N = sum_i |o_i|``:

    - ``token-mean``: ``sum_{i,t} l_it / N`` (DAPO, Yu et al. 2025): every token weighs the same, so longer
      responses weigh more. The default (``auto``) for every estimator but ``dr_grpo``.
    - ``seq-mean-token-mean``: ``1/B sum_i (1/|o_i|) sum_t l_it`` (GRPO as written, Shao et al. 2024): every
      response weighs the same, so a token of a short response weighs more than one of a long response.
    - ``seq-mean-token-sum``: ``1/B sum_i sum_t l_it``: a response's loss is its token sum.
    - ``seq-mean-token-sum-norm``: ``sum_{i,t} l_it / (B * max_response_tokens)`` (Dr.GRPO, Liu et al. 2025): a
      constant divisor, so a token's weight depends on neither its own nor the other responses' lengths. The
      default (``auto``) for ``dr_grpo``.

    The KL-in-loss, entropy and value terms are aggregated the same way."""

    max_response_tokens: int | None = Field(None, ge=1)
    """The rollout's generation budget: the ``seq-mean-token-sum-norm`` constant's per-sequence length, and
    ``L_max`` of the soft overlong punishment (``overlong_buffer_len``). A recipe fills it from
    ``rollout.sampling.max_new_tokens`` when unset; both refuse ``None`` (the longest response of each batch
    would not be a constant)."""

    ppo_epochs: int = Field(1, ge=1)
    """Passes over each sampled batch (verl's ``ppo_epochs``). Each pass makes ``mini_batches`` optimizer
    updates; the batch is one policy version whatever the count (the learner publishes once per batch)."""

    mini_batches: int = Field(1, ge=1)
    """Optimizer updates per pass over a sampled batch (verl's ``ppo_mini_batch_size`` as a count): the rows
    are split into this many contiguous, equal mini-batches, each aggregated on its own (``loss_agg_mode``).
    The batch's rows must be a multiple of it (times the learner world size with ``batch_split: shard``).

    With ``ppo_epochs * mini_batches == 1`` (the default) the PPO anchor ``pi_prox`` is the same parameters as
    the policy being updated, so ``pi / pi_prox == 1`` and the clip (``clip_eps_low/high``, ``dual_clip_c``)
    never acts: the step is the importance-weighted policy gradient of ``policy_ratio``'s anchor, and only
    ``policy_ratio: behaviour`` can clip (against the rollout's logprobs). With more updates the proximal
    logprobs are computed once, before the first update, in a no-grad pass with dropout off, and every later
    update is clipped against them (PPO, Schulman et al. 2017; decoupled PPO, AReaL)."""

    dual_clip_c: float | None = Field(None, gt=1.0)
    """Dual-clip PPO (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL"): for tokens with
    a negative advantage the clipped objective is further bounded, ``max(min(r A, clip(r) A), c A)``, so a
    ratio far above 1 (a stale or off-policy token) cannot make the loss arbitrarily large. verl's
    ``clip_ratio_c`` (3.0 there). ``None``: off. The ``dual_clip_frac`` metric counts the tokens it bounds."""

    kl_coef: float = Field(0.0, ge=0.0)
    """Coefficient ``beta`` of the KL regulariser to a frozen reference model (the initial weights), placed
    by ``kl_placement``; with ``kl_ctrl.type: adaptive`` its initial value. The reference model is loaded only
    when this is > 0."""

    kl_ctrl: KLControlConfig = KLControlConfig()
    """How ``beta`` moves from ``kl_coef`` (verl's ``algorithm.kl_ctrl``; ``learner.algo.kl_control``): ``fixed``
    (default) or ``adaptive`` toward ``target_kl`` over ``horizon`` trajectories (Ziegler et al. 2019, §2.2)."""

    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """Per-token function of ``x = log pi(a_t) - log pi_ref(a_t)`` on the sampled tokens (Schulman,
    http://joschu.net/blog/kl-approx.html): ``k1 = x``, ``k2 = x^2 / 2``, ``k3 = exp(-x) - 1 + x``. Which KL
    each one *trains* is the expected gradient of ``beta * k`` as a loss over on-policy tokens (Tang & Munos
    2025, "On a few pitfalls in KL divergence gradient estimation for RL"), listed in ``KL_LOSS_GRADIENT``:
    ``k2`` -> ``grad KL(pi || pi_ref)``; ``k3`` -> ``grad KL(pi_ref || pi)`` (the reversed KL, although its
    *value* estimates ``KL(pi || pi_ref)``); ``k1`` -> 0 (refused as a loss: noise and no pull toward the
    reference). With ``kl_placement: reward`` it must be ``k1``: the reward is ``-beta * x``."""

    kl_placement: Literal["loss", "reward"] = "loss"
    """Where ``kl_coef`` acts (verl's ``actor.use_kl_loss`` / ``algorithm.use_kl_in_reward``). ``loss``:
    ``beta * kl_estimator(x)`` is added to every valid token's loss, normalised like the policy loss (GRPO,
    Shao et al. 2024). ``reward``: ``-beta * sg(x)`` is added to every response token's reward before the
    advantages (PPO-RLHF: Ziegler et al. 2019, Ouyang et al. 2022), ``x`` from the learner's own logprobs at
    the start of the step (dropout off); ``gae`` takes these per-token rewards, the outcome estimators the
    row's return ``r - beta * sum_t x_t`` (grouped as usual). The policy-gradient term then follows
    ``beta * grad KL(pi || pi_ref)`` of the whole response, including the effect of each token on the
    later positions' KL (which a per-token loss leaves out)."""

    entropy_coef: float = Field(0.0, ge=0.0)
    """Coefficient of the entropy bonus: ``entropy_coef`` times the entropy aggregated like the policy loss
    (``loss_agg_mode``) is subtracted from the loss. ``H_t`` is the exact entropy (nats) of the whole
    next-token distribution ``softmax(logits / temperature)`` at response position ``t`` given the sampled
    prefix (not the sampled token's ``-log pi``), over the (mini-)batch's valid response tokens (prompt and
    padding excluded): so the bonus is the token mean of ``H`` with ``token-mean``, and the mean over responses
    of each response's token mean with ``seq-mean-token-mean``. The ``entropy`` metric is the token mean."""

    gamma: float = Field(1.0, ge=0.0, le=1.0)
    """GAE discount (``advantage: gae`` only)."""

    lam: float = Field(0.95, ge=0.0, le=1.0)
    """GAE lambda (``advantage: gae`` only): 0 is one-step TD, 1 is the Monte-Carlo return minus V."""

    value_coef: float = Field(0.5, gt=0.0)
    """Weight of the critic's clipped value loss in the total loss (``advantage: gae`` only)."""

    value_clip: float = Field(0.2, gt=0.0)
    """PPO value clipping: the new value may move at most this far from the step-start value
    before the clipped branch of ``max((V - R)^2, (V_clip - R)^2)`` takes over (``advantage: gae``)."""

    adv_eps: float = Field(1e-6, gt=0.0)
    """Added to the reward std before dividing (``grpo``, ``reinforce_pp``); keeps equal-reward groups
    at 0 advantage."""

    temperature: float = Field(1.0, gt=0.0)
    """Sampling temperature the rollout used. vLLM reports ``processed_logprobs`` (after temperature),
    so the learner divides its logits by the same value before the log-softmax. The rollout must not
    use top-k/top-p, which would renormalise the behaviour distribution."""

    overlong_filter: bool = False
    """DAPO's overlong filtering (Yu et al. 2025, "Overlong Filtering"): a row the rollout cut at its budget
    (``finish_reason == "length"``) is masked out of the loss: its ``TrainBatch.response_mask`` is all False,
    so it neither trains nor counts in the ``token-mean`` normaliser (the ``seq-mean-*`` modes still count it in
    ``B``). It keeps its reward in its group's baseline, as sampled: the baseline estimates
    the prompt's expected reward under the policy that drew all ``n`` samples, and dropping truncated ones
    would condition it on finishing (and leave groups ragged). With ``kl_placement: reward`` its return in
    the baseline is its reward without a KL term (its tokens are masked). Off: truncated rows train like
    finished ones. The ``truncated_frac`` metric is reported either way."""

    overlong_buffer_len: int = Field(0, ge=0)
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13; verl's ``reward_model.overlong_buffer.len``):
    the last ``L_cache`` tokens of the generation budget ``L_max = max_response_tokens``. A response of ``|y|``
    tokens gets ``0`` for ``|y| <= L_max - L_cache``, ``(L_max - L_cache - |y|) / L_cache *
    overlong_penalty_factor`` for ``L_max - L_cache < |y| <= L_max`` (down to ``-overlong_penalty_factor``), and
    ``-overlong_penalty_factor`` beyond ``L_max``; this is added to the verifier's reward before the advantages
    (every estimator; ``gae`` sees it on the last token). ``reward_mean`` / ``reward_std`` stay the verifier's
    raw reward; ``overlong_penalty_mean`` is the batch's mean penalty. 0: off. When > 0 it needs
    ``max_response_tokens`` set (a recipe fills it from ``rollout.sampling.max_new_tokens``) and greater than
    this."""

    overlong_penalty_factor: float = Field(1.0, gt=0.0)
    """The soft overlong punishment's magnitude at ``|y| = L_max`` (verl's
    ``overlong_buffer.penalty_factor``; DAPO uses 1.0, the scale of a 0/1 verifier reward). Only with
    ``overlong_buffer_len > 0``."""

    failed_scores: Literal["mask_rows", "drop_groups"] = "mask_rows"
    """What a row whose reward failed (a non-empty ``reward_error``: the scorer raised, returned None or a
    non-number, timed out, or its sandbox failed; stored reward 0.0) does in training. ``mask_rows``: it is left
    out of the loss (no response tokens, not in the token normaliser) and out of its group's baseline, which the
    group's other samples form; a group left with fewer than 2 scored rows has no baseline and none of its rows
    trains (``advantage: gae`` needs no baseline: only the failed rows are left out). ``drop_groups``: every row
    of a group with a failed row is left out. Either way the failure is recorded on the trajectory, and the
    ``reward_error_frac`` (failed rows) and ``reward_error_untrained_frac`` (rows left out for it) metrics
    count them. A 0 in place of a verdict would train as a real score."""

    @field_validator("advantage", "loss")
    @classmethod
    def _builtin_or_import_path(cls, value: str, info: ValidationInfo) -> str:
        builtins = get_args(BuiltinAdvantage if info.field_name == "advantage" else BuiltinLoss)
        if value in builtins:
            return value
        try:
            split_spec(value)
        except CallableSpecError as exc:
            raise ValueError(f"{info.field_name} {value!r}: {exc}; expected one of {', '.join(builtins)} or an import "
                             "path 'pkg.module:fn' / 'path/to/file.py:fn' (see learner.objectives)") from None
        return resolve_file_spec(value, Path.cwd())  # a relative file: from where gyre runs, as reward files

    @model_validator(mode="after")
    def _check_overlong(self) -> AlgorithmConfig:
        if self.overlong_buffer_len > 0 and self.max_response_tokens is None:
            raise ValueError(
                f"overlong_buffer_len ({self.overlong_buffer_len}) needs the generation budget L_max: set "
                "max_response_tokens to the rollout's max_new_tokens (a recipe fills it); got max_response_tokens None"
            )
        if self.overlong_buffer_len > 0 and self.overlong_buffer_len >= self.max_response_tokens:
            raise ValueError(
                f"overlong_buffer_len ({self.overlong_buffer_len}) must be < max_response_tokens "
                f"({self.max_response_tokens}): the buffer is the last part of the generation budget"
            )
        return self

    @model_validator(mode="before")
    @classmethod
    def _renamed_keys(cls, data: Any) -> Any:
        if isinstance(data, dict) and "loss_norm" in data:
            raise ValueError(
                f"loss_norm ({data['loss_norm']!r}) is now loss_agg_mode (verl's names): token_mean -> 'token-mean', "
                "token_sum -> 'seq-mean-token-sum-norm'; also 'seq-mean-token-mean', 'seq-mean-token-sum', 'auto'"
            )
        return data

    @model_validator(mode="after")
    def _check_combinations(self) -> AlgorithmConfig:
        if self.policy_ratio == "behaviour" and self.is_weight.startswith("tis"):
            raise ValueError(
                f"is_weight ({self.is_weight!r}) with policy_ratio 'behaviour' corrects the behaviour gap "
                "twice; expected is_weight 'none', 'mis_token' or 'mis_seq' (or policy_ratio 'proximal')"
            )
        if self.kl_placement == "loss" and KL_LOSS_GRADIENT[self.kl_estimator] is None:
            raise ValueError(
                f"kl_estimator {self.kl_estimator!r} as a loss has zero expected gradient (E_pi[grad log pi] = 0): "
                "it adds noise and no pull toward the reference; expected kl_estimator 'k2' (trains "
                "KL(pi || pi_ref)) or 'k3' (trains KL(pi_ref || pi)), or kl_placement 'reward' (k1 in the reward)"
            )
        if self.kl_placement == "reward" and self.kl_estimator != "k1":
            raise ValueError(
                f"kl_placement 'reward' adds -kl_coef * x (the k1 value) to each token's reward; got kl_estimator "
                f"{self.kl_estimator!r}, expected 'k1' (or kl_placement 'loss' for k2/k3)"
            )
        if self.agg_mode == "seq-mean-token-sum-norm" and self.max_response_tokens is None:
            raise ValueError(
                f"loss_agg_mode {self.agg_mode!r} (advantage {self.advantage!r}) divides by the constant "
                "B * max_response_tokens, but max_response_tokens is None: set it to the rollout's max_new_tokens "
                "(a recipe does this itself)"
            )
        if self.mis_low >= self.mis_high:
            raise ValueError(f"mis_low ({self.mis_low}) must be < mis_high ({self.mis_high})")
        check_kl_ctrl(self.kl_ctrl, self.kl_coef)
        return self

    @property
    def agg_mode(self) -> str:
        """``loss_agg_mode`` with ``auto`` resolved: ``seq-mean-token-sum-norm`` for ``dr_grpo``, else
        ``token-mean``."""
        if self.loss_agg_mode != "auto":
            return self.loss_agg_mode
        return "seq-mean-token-sum-norm" if self.advantage == "dr_grpo" else "token-mean"

    @property
    def custom_advantage(self) -> bool:
        """``advantage`` is an import path (``learner.objectives``), not a built-in estimator."""
        return self.advantage not in get_args(BuiltinAdvantage)

    @property
    def custom_loss(self) -> bool:
        """``loss`` is an import path (``learner.objectives``), not the built-in ``ppo_clip``."""
        return self.loss not in get_args(BuiltinLoss)

    @property
    def updates_per_batch(self) -> int:
        """Optimizer updates per sampled batch: ``ppo_epochs * mini_batches``."""
        return self.ppo_epochs * self.mini_batches


# The engine's settings live in their own file; imported here so ``gyre.learner.config`` names both configs.
from gyre.learner.engine_config import DEFAULT_MICRO_BATCH_ROWS, LearnerConfig  # noqa: E402,F401
