"""Custom objectives (``learner.objectives``): ``learner.algorithm.advantage`` / ``loss`` as import paths, checked
on a synthetic batch when the config loads (``learner.algo.objective_check``), and called where the built-ins are.
The engine step itself (bit-identical parameters) is ``tests/integration/test_learner_objectives.py``."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from examples.objectives.advantages import batch_loo
from examples.objectives.losses import clipped_is_pg
from gyre.learner.batch import build_train_batch
from gyre.learner.config import AlgorithmConfig, LearnerConfig
from gyre.learner.algo.kl_control import KLController
from gyre.learner.loop_config import LearnerLoopConfig
from gyre.learner.algo.losses import policy_loss
from gyre.learner.algo.objective_check import check_objectives, synthetic_advantage_inputs
from gyre.learner.algo.objectives import LossInputs, ObjectiveError, custom_policy_loss
from gyre.learner.step_start import step_targets
from gyre.proto.trajectory import Trajectory, make_ids, to_table
from gyre.services.control.recipe.schema import RecipeError, load_recipe
from tests.unit.learner import objective_fns

FNS = "tests.unit.learner.objective_fns"
EXAMPLE_ADV = "examples/objectives/advantages.py:batch_loo"
EXAMPLE_LOSS = "examples.objectives.losses:clipped_is_pg"


def _loop(**algorithm) -> LearnerLoopConfig:
    """The recipe's ``learner`` section with this ``algorithm`` (validated as a recipe load validates it)."""
    return LearnerLoopConfig(engine=LearnerConfig(model="/nonexistent"), algorithm=algorithm)


def _traj(prompt_index, sample_index, prompt, response, reward, error="", version=3) -> Trajectory:
    tid, gid = make_ids(prompt_index, sample_index, 0)
    return Trajectory(
        trajectory_id=tid, group_id=gid, prompt_index=prompt_index, sample_index=sample_index, attempt=0, task="t",
        prompt_token_ids=list(prompt), response_token_ids=list(response),
        behaviour_logprobs=[-t / 100 for t in response], reward=reward, reward_error=error, finish_reason="stop",
        version_span_starts=[0], version_span_versions=[version], reward_fn_version="v1", rollout_id="r0",
        created_at=0.0)


def _table(error_row: int | None = None):
    rows = [
        _traj(7, 0, [11, 12, 13], [101, 102], 1.0),
        _traj(9, 0, [21, 22], [201, 202, 203, 204], 0.0, version=1),
        _traj(7, 1, [11, 12, 13], [111], 0.0),
        _traj(9, 1, [21, 22], [211], 0.5, version=2),
        _traj(7, 2, [11, 12, 13], [121, 122, 123], 0.25),
        _traj(9, 2, [21, 22], [221, 222], 1.0),
    ]
    if error_row is not None:
        rows[error_row] = _traj(9, 2, [21, 22], [221, 222], 0.0, error="raised: boom")
    return to_table(rows)


# ---- the names a config takes --------------------------------------------------------------------------------

def test_builtin_names_and_import_paths_are_taken_and_anything_else_is_named():
    assert AlgorithmConfig().advantage == "grpo" and AlgorithmConfig().loss == "ppo_clip"
    cfg = AlgorithmConfig(advantage=f"{FNS}:grpo", loss=f"{FNS}:ppo_clip")
    assert cfg.custom_advantage and cfg.custom_loss and not AlgorithmConfig(advantage="gae").custom_advantage
    for key, value, message in [
        ("advantage", "grpoo", "advantage 'grpoo': not of the form target:function; expected one of grpo, "
                               "dr_grpo, rloo, reinforce_pp, gae or an import path"),
        ("loss", "my-pkg.mod:fn", "loss 'my-pkg.mod:fn': 'my-pkg.mod' is neither a dotted module name nor a .py "
                                  "file; expected one of ppo_clip or an import path"),
        ("loss", "pkg.mod:", "not of the form target:function"),
    ]:
        with pytest.raises(ValueError, match="learner.objectives") as err:
            AlgorithmConfig(**{key: value})
        assert message in str(err.value)


def test_a_relative_file_path_is_made_absolute_from_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert AlgorithmConfig(loss="objs/mine.py:loss").loss == f"{tmp_path}/objs/mine.py:loss"
    assert AlgorithmConfig(loss="/abs/mine.py:loss").loss == "/abs/mine.py:loss"
    assert AlgorithmConfig(loss="pkg.mine:loss").loss == "pkg.mine:loss"


# ---- the load-time check -------------------------------------------------------------------------------------

@pytest.mark.parametrize("key, name, message", [
    ("advantage", "wrong_shape", "the returned advantages tensor has shape [4, 3]; expected [B] = [4] or "
                                 "[B, T] = [4, 5]"),
    ("advantage", "float64", "the returned advantages tensor has dtype torch.float64; expected torch.float32"),
    ("advantage", "nan_advantage", "the returned advantages tensor has 4 non-finite value(s) (NaN or inf) of 4"),
    ("advantage", "a_list", "the returned advantages tensor is a list; expected a torch.Tensor of shape [B] = [4]"),
    ("advantage", "raises", "raised RuntimeError: boom"),
    ("loss", "per_row_loss", "the returned loss has shape [4]; expected [] (0-dim)"),
    ("loss", "detached_loss", "the returned loss does not require grad: it has no gradient path to inputs.logprobs"),
    ("loss", "nan_loss", "the returned loss has 1 non-finite value(s)"),
    ("loss", "leaks_off_mask", "the gradient w.r.t. inputs.logprobs is non-zero at 10 position(s) off "
                               "response_mask"),
    ("loss", "infinite_gradient", "the gradient w.r.t. inputs.logprobs has non-finite values"),
    ("loss", "bad_metric", "metric 'clip' = 'high' is not a finite real number"),
])
def test_a_function_that_breaks_the_contract_is_refused_on_the_synthetic_batch(key, name, message):
    spec = f"{FNS}:{name}"
    with pytest.raises(ValueError) as err:
        _loop(**{key: spec})
    text = str(err.value)
    assert f"learner.algorithm.{key} {spec!r}: " in text and message in text, text
    assert "synthetic batch" in text and "the contract: fn(inputs: learner.objectives." in text


@pytest.mark.parametrize("key, spec, message", [
    ("loss", "gyre_no_such_pkg.mod:fn", "module 'gyre_no_such_pkg.mod' does not import: ModuleNotFoundError"),
    ("advantage", f"{FNS}:nope", f"{FNS} has no attribute 'nope' (its callables: "),
    ("advantage", f"{FNS}:not_callable", "'not_callable' is a int, not callable"),
    ("loss", f"{FNS}:two_arguments", "two_arguments(inputs, extra) cannot be called with one argument"),
    ("loss", "/no/such/objective.py:fn", "file /no/such/objective.py does not exist"),
])
def test_a_path_that_does_not_load_is_refused_naming_the_path(key, spec, message):
    with pytest.raises(ObjectiveError) as err:
        check_objectives(AlgorithmConfig(**{key: spec}))
    assert str(err.value).startswith(f"learner.algorithm.{key} {spec!r}: ") and message in str(err.value)
    assert "synthetic batch" not in str(err.value)


def test_the_recipe_load_refuses_a_bad_objective_naming_the_key(tmp_path):
    with pytest.raises(RecipeError) as err:
        load_recipe("deploy/recipes/tiny-test.yaml", {"learner.algorithm.loss": f"{FNS}:per_row_loss",
                                                      "run_dir": str(tmp_path)})
    assert "learner.algorithm: Value error, learner.algorithm.loss" in str(err.value)
    assert "the returned loss has shape [4]; expected [] (0-dim)" in str(err.value)
    recipe = load_recipe("deploy/recipes/tiny-test.yaml", {"learner.algorithm.advantage": EXAMPLE_ADV,
                                                           "learner.algorithm.loss": EXAMPLE_LOSS,
                                                           "run_dir": str(tmp_path)})
    assert recipe.learner.algorithm.advantage.endswith("/examples/objectives/advantages.py:batch_loo")


def test_the_check_is_fast_and_the_examples_pass_it_with_every_aggregation_and_estimator():
    start = time.perf_counter()
    check_objectives(AlgorithmConfig(advantage=EXAMPLE_ADV, loss=EXAMPLE_LOSS))
    assert time.perf_counter() - start < 1.0
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        for advantage in ("grpo", "gae", EXAMPLE_ADV, f"{FNS}:per_token_ones"):
            check_objectives(AlgorithmConfig(advantage=advantage, loss=EXAMPLE_LOSS, loss_agg_mode=mode,
                                             max_response_tokens=8))


# ---- where the learner calls them ------------------------------------------------------------------------------

def test_a_custom_advantage_builds_the_batch_as_the_builtin_it_copies():
    builtin = build_train_batch(_table(), 0, 4, AlgorithmConfig())
    objective_fns.SEEN.clear()
    custom = build_train_batch(_table(), 0, 4, AlgorithmConfig(advantage=f"{FNS}:recording_grpo"))
    assert torch.equal(custom.advantages, builtin.advantages) and builtin.advantages.abs().sum() > 0
    (seen,) = objective_fns.SEEN
    assert torch.equal(seen.rewards, builtin.shaped_rewards) and seen.group_rows.tolist() == [[0, 2, 4], [1, 3, 5]]
    assert torch.equal(seen.response_mask, builtin.response_mask) and seen.scored.all()
    assert torch.equal(seen.behaviour_logprobs, builtin.behaviour_logprobs)
    assert seen.staleness.tolist() == [1, 3, 1, 2, 1, 1] and seen.cfg.advantage == f"{FNS}:recording_grpo"


def test_per_token_advantages_are_zeroed_off_the_mask_and_on_failed_rows():
    batch = build_train_batch(_table(error_row=5), 0, 4, AlgorithmConfig(advantage=f"{FNS}:per_token_ones"))
    assert batch.advantages.shape == batch.response_mask.shape
    assert torch.equal(batch.advantages, batch.response_mask.float())
    assert batch.reward_failed.tolist() == [False] * 5 + [True] and not batch.response_mask[5].any()
    assert batch.baseline_rows.tolist() == [True] * 5 + [False]


def test_the_example_batch_loo_advantage_leaves_each_row_out_of_its_baseline():
    batch = build_train_batch(_table(error_row=5), 0, 4, AlgorithmConfig(advantage=EXAMPLE_ADV))
    rewards = [1.0, 0.0, 0.0, 0.5, 0.25]  # row 5's score failed: out of every baseline, advantage 0
    expected = [r - (sum(rewards) - r) / 4 for r in rewards] + [0.0]
    assert batch.advantages.tolist() == pytest.approx(expected, abs=1e-6)
    one = synthetic_advantage_inputs(AlgorithmConfig())
    lonely = one.__class__(**{**one.__dict__, "scored": torch.tensor([True, False, False, False])})
    assert batch_loo(lonely).tolist() == [0.0] * 4


class _FakeLearner:
    """What ``step_targets`` reads of a learner: embeddings as the policy and the reference model."""

    def __init__(self, algo: AlgorithmConfig):
        torch.manual_seed(0)
        self.algo, self.critic = algo, False
        self.engine, self.ref_model = torch.nn.Embedding(256, 256), torch.nn.Embedding(256, 256)
        self.kl_ctrl = KLController(algo.kl_coef, algo.kl_ctrl)

    def _micro_plan(self, batch, rows=None):
        return [torch.arange(lo, min(lo + 4, batch.batch_size)) for lo in range(0, batch.batch_size, 4)], 1

    def _pass(self, batch, rows, entropy=False):
        from gyre.learner.algo.logprobs import token_logprobs
        ids, mask = batch.input_ids[rows], batch.response_mask[rows]
        return SimpleNamespace(logprobs=token_logprobs(self.engine(ids), ids) * mask, mask=mask, values=None)

    def _ref_logprobs(self, batch, rows):
        from gyre.learner.algo.logprobs import token_logprobs
        ids = batch.input_ids[rows]
        return token_logprobs(self.ref_model(ids), ids) * batch.response_mask[rows]


def test_with_the_kl_in_the_reward_a_custom_advantage_gets_the_kl_shaped_returns():
    base = dict(kl_coef=0.5, kl_placement="reward", kl_estimator="k1")
    builtin_cfg, custom_cfg = AlgorithmConfig(**base), AlgorithmConfig(**base, advantage=f"{FNS}:recording_grpo")
    builtin = step_targets(_FakeLearner(builtin_cfg), build_train_batch(_table(), 0, 4, builtin_cfg))
    objective_fns.SEEN.clear()
    custom = step_targets(_FakeLearner(custom_cfg), build_train_batch(_table(), 0, 4, custom_cfg))
    assert torch.equal(custom.advantages, builtin.advantages)
    shaped = objective_fns.SEEN[-1].rewards  # the second call: after the step-start pass
    assert not torch.equal(shaped, objective_fns.SEEN[0].rewards) and torch.equal(shaped, builtin.returns)


def _loss_inputs(cfg: AlgorithmConfig, grad: bool = True):
    inputs = synthetic_advantage_inputs(cfg)
    torch.manual_seed(1)
    logprobs = (inputs.behaviour_logprobs + 0.3 * torch.randn(inputs.response_mask.shape)).requires_grad_(grad)
    proximal = inputs.behaviour_logprobs + 0.1 * torch.randn(inputs.response_mask.shape)
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    return logprobs, proximal, inputs.behaviour_logprobs, advantages, inputs.response_mask, cfg, 13.0, None


def test_a_custom_loss_that_copies_ppo_clip_gives_its_loss_gradient_and_metrics():
    cfg = AlgorithmConfig(loss=f"{FNS}:ppo_clip", is_weight="tis_seq")
    args = _loss_inputs(cfg)
    custom, metrics = custom_policy_loss(*args)
    (grad_custom,) = torch.autograd.grad(custom, args[0])
    builtin, builtin_metrics = policy_loss(*args)
    (grad_builtin,) = torch.autograd.grad(builtin, args[0])
    assert torch.equal(custom, builtin) and torch.equal(grad_custom, grad_builtin)
    for key in ("is_ratio_mean", "is_ratio_max", "approx_kl", "valid_tokens"):
        assert metrics[key] == builtin_metrics[key], key
    assert metrics["custom_loss/ppo_clip_frac"] == builtin_metrics["ppo_clip_frac"]
    assert "ppo_clip_frac" not in metrics  # only the loss-free diagnostics keep their names


def test_the_example_clipped_is_pg_loss_is_its_formula():
    cfg = AlgorithmConfig(loss=EXAMPLE_LOSS, tis_cap=1.1)
    logprobs, proximal, behaviour, advantages, mask, _, normaliser, _ = _loss_inputs(cfg)
    loss, metrics = clipped_is_pg(LossInputs(logprobs, proximal, behaviour, advantages, mask, cfg, normaliser, None))
    ratio = torch.exp(logprobs.detach() - behaviour)[mask]
    weight = ratio.clamp(max=1.1)
    adv = advantages.unsqueeze(1).expand_as(mask)[mask]
    assert loss.item() == pytest.approx(float((-weight * adv * logprobs.detach()[mask]).sum() / normaliser), rel=1e-6)
    (grad,) = torch.autograd.grad(loss, logprobs)
    assert torch.allclose(grad[mask], -weight * adv / normaliser) and not grad[~mask].any()
    assert 0 < metrics["ratio_clip_frac"] < 1 and metrics["ratio_clip_frac"] == float((ratio > 1.1).float().mean())


def test_the_docs_render_every_field_of_the_contract():
    import dataclasses

    from gyre.learner.algo.objectives import AdvantageInputs
    from gyre.services.cli.reference_docs import objectives_reference

    page = objectives_reference()
    for cls in (AdvantageInputs, LossInputs):
        for field in dataclasses.fields(cls):
            row = next(line for line in page.splitlines() if line.startswith(f"| `{field.name}` |"))
            assert len(row) > len(field.name) + 20, row  # the field's docstring is in the row
    assert "`LossInputs.aggregate(per_token)`" in page
