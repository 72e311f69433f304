"""Live reward swaps (``gyre reward swap``, ``services.control.commands.reward_swaps``) without Ray: what is refused before
anything reaches the run, the all-or-nothing apply over the fleet, the journal written before the commit, and that
rollouts created afterwards (restarted, added, or by a new driver) start with the swapped reward."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from gyre.proto.journal import read_journal
from gyre.rollout.tasks import TaskConfig, TaskSource
from gyre.services.cli import main as cli
from gyre.services.common.service_info import RolloutInfo
from gyre.services.control.commands import ops
from gyre.services.control.orchestration import supervisor as sup_mod
from gyre.services.control.orchestration.factory import ServiceFactory
from gyre.services.control.recipe.schema import load_recipe
from gyre.services.control.commands.reward_swaps import (SWAP_JOURNAL, RewardSwapError, RewardSwaps, canonical_swap, check_swap,
                                           parse_swap_config)
from tests.unit.services.supervisor_fakes import FakeHandle, _health_round, learner_info, unstarted

TASK = "basic_arithmetic"
DEFAULT = "rg-last-int-exact-v1"
SWAP = {TASK: [{"name": "math_exact"}]}


class FakeRollout:
    """A rollout double around a real ``TaskSource`` built from the task config it was created with (as
    ``RolloutActor.setup`` builds it), answering the swap calls as ``RolloutActor`` does."""

    def __init__(self, name: str, task: dict, refuse: bool = False) -> None:
        self.created_with, self.task, self.staged, self.refuse = task, TaskSource(TaskConfig(**task)), None, refuse
        self.handle = FakeHandle(name, setup=lambda: 1, describe=self.describe, prepare_reward=self.prepare,
                                 commit_reward=self.commit, abort_reward=self.abort, swap_reward=self.task.swap_reward)

    def describe(self) -> RolloutInfo:
        return RolloutInfo(pid=1, node="n", version=5, generating=True, tokens_per_s=0.0,
                           reward_versions=self.task.reward_versions())

    def prepare(self, config):
        if self.refuse:
            raise ValueError(f"reward 'math_exact' does not fit task {TASK!r}: 'answer'")
        self.staged = self.task.prepare_swap(config)
        return {**self.task.reward_versions(), **{t: r.version for t, r in self.staged.items()}}

    def commit(self):
        self.journal_at_commit = read_journal(self.journal_path).events
        versions, self.staged = self.task.commit_swap(self.staged), None
        return versions

    def abort(self):
        self.staged = None


@pytest.fixture
def sup(monkeypatch, tmp_path):
    """A supervisor with two generating ``FakeRollout``s; ``sup.fakes``: rollout name → its newest double."""
    s = unstarted(monkeypatch)
    s.factory.swaps = RewardSwaps(TaskConfig(), tmp_path / SWAP_JOURNAL)
    s.fakes = {}

    def begin_rollout(index, replay_address, weights_address, reward_model_address=None):  # as ServiceFactory.begin_rollout: the task in force
        fake = FakeRollout(f"rollout-{index}", s.factory.swaps.task_config().model_dump(),
                           refuse=index in s.refusing)
        fake.journal_path = s.factory.swaps.path
        s.fakes[fake.handle.name] = fake
        return fake.handle, fake.handle.setup.remote()

    s.refusing = set()
    s.factory.begin_rollout = begin_rollout
    s.start(2)
    s.state_body.request_scale("rollout", 2)
    s.learner.info = learner_info()
    s.generating = True
    return s


def versions(s) -> dict[str, dict]:
    return {name: fake.task.reward_versions() for name, fake in s.fakes.items()}


def test_a_swap_is_journaled_then_applied_to_every_rollout_and_shown_in_status(sup):
    swap_id = sup.state_body.request_reward_swap(SWAP)
    sup.tick()
    result = sup.state_body.reward_swap_result(swap_id)
    assert result["ok"] and result["versions"] == {TASK: "math-exact-v1"}, result
    assert result["rollouts"] == ["rollout-0", "rollout-1"]
    assert versions(sup) == {"rollout-0": {TASK: "math-exact-v1"}, "rollout-1": {TASK: "math-exact-v1"}}
    for fake in sup.fakes.values():  # journaled (fsync'd) before any rollout committed it
        assert [e["rewards"] for e in fake.journal_at_commit] == [SWAP]
    sup.tick()  # the next describe() carries the new versions
    text = ops.format_status(sup.state_body.status())
    assert f"rewards    {TASK}=math-exact-v1 on rollout-0, rollout-1" in text
    assert "1 reward swap(s) journaled" in text
    st = sup.state_body.status()  # rollouts listed in index order, whatever order they joined in
    st["services"] = st["services"][::-1]
    assert f"{TASK}=math-exact-v1 on rollout-0, rollout-1" in ops.format_status(st)


def test_a_refusal_by_one_rollout_leaves_none_swapped_and_nothing_journaled(sup):
    sup.fakes["rollout-1"].refuse = True
    swap_id = sup.state_body.request_reward_swap(SWAP)
    sup.tick()
    result = sup.state_body.reward_swap_result(swap_id)
    assert not result["ok"] and result["versions"] == {}
    assert result["error"] == (f"rollout-1 refused the reward swap: ValueError: reward 'math_exact' does not fit "
                               f"task {TASK!r}: 'answer'")
    assert versions(sup) == {"rollout-0": {TASK: DEFAULT}, "rollout-1": {TASK: DEFAULT}}
    assert sup.fakes["rollout-0"].staged is None  # rollout-0 had prepared it: dropped, never committed
    assert ("abort_reward", ()) in sup.fakes["rollout-0"].handle.calls
    assert not sup.factory.swaps.path.exists() and sup.factory.swaps.task_config() == TaskConfig()


def test_restarted_and_added_rollouts_start_with_the_swapped_reward(sup, monkeypatch):
    sup.state_body.request_reward_swap(SWAP)
    sup.tick()
    old = sup.fakes["rollout-0"]
    old.handle.killed = True  # its process died: restarted with the task in force
    sup.state_body.request_scale("rollout", 3)  # and one more added
    sup.tick()
    assert sup.fakes["rollout-0"] is not old and sorted(sup.starting) == []
    for name in ("rollout-0", "rollout-2"):
        fake = sup.fakes[name]
        assert [r["name"] for r in fake.created_with["rewards"]] == ["math_exact"], name
        assert fake.created_with["reward"] is None
        assert fake.task.reward_versions() == {TASK: "math-exact-v1"}
        assert ("swap_reward", (sup.factory.swaps.in_force,)) not in fake.handle.calls  # needed no catch-up


def test_a_rollout_starting_during_a_swap_joins_with_it(sup, monkeypatch):
    ready = {"setup": False}
    monkeypatch.setattr(sup_mod.ray, "wait", lambda refs, num_returns=1, timeout=0: (refs, []) if ready["setup"] or
                        _health_round(refs) else ([], refs))
    sup.state_body.request_scale("rollout", 3)
    sup.tick()  # rollout-2 created with the recipe's reward, still starting
    assert "rollout-2" in sup.starting and sup.fakes["rollout-2"].created_with["rewards"] is None
    sup.state_body.request_reward_swap(SWAP)
    sup.tick()  # applied to the two running rollouts
    ready["setup"] = True
    sup.tick()  # rollout-2 joins: the swap accepted while it started is put in force first
    assert versions(sup)["rollout-2"] == {TASK: "math-exact-v1"} and "rollout-2" in sup.services


def test_a_new_driver_and_the_real_factory_create_rollouts_with_the_journaled_swap(sup, tmp_path, monkeypatch):
    sup.state_body.request_reward_swap(SWAP)
    sup.tick()
    again = RewardSwaps(TaskConfig(), tmp_path / SWAP_JOURNAL)  # what a new `gyre run` of the run reads
    assert again.count == 1 and again.in_force == SWAP and again.task_config().rewards[0].name == "math_exact"
    recipe = load_recipe("deploy/recipes/tiny-test.yaml", {"run_dir": str(tmp_path), "name": "r"}, dry_run=True)
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / SWAP_JOURNAL).write_bytes((tmp_path / SWAP_JOURNAL).read_bytes())
    factory = ServiceFactory(recipe, {}, "fp")
    setups = []
    handle = SimpleNamespace(setup=SimpleNamespace(remote=lambda *args, **kw: setups.append(args)))
    monkeypatch.setattr(factory, "_create", lambda cls, role, name: handle)
    factory.begin_rollout(0, "replay:1", "weights:1")
    task = setups[0][2]  # setup(name, rollout config, task config, ...)
    assert task["rewards"] == [{"name": "math_exact", "params": {}, "function": None, "model": None,
                                "kind": "classifier", "weight": 1.0, "timeout_s": 30.0}] and task["reward"] is None
    assert recipe.task.reward.name == "char_fraction"  # the recipe (and the checkpoints' fingerprint) unchanged


def test_swap_configs_are_refused_naming_the_bad_value(tmp_path):
    task = TaskConfig()
    with pytest.raises(RewardSwapError, match=r"unknown task 'countdown'; this run's tasks: \['basic_arithmetic'\]"):
        canonical_swap({"countdown": "math_exact"}, task, tmp_path)
    with pytest.raises(RewardSwapError, match=r"reward \{'name': 'math_exact', 'wieght': 2\} is invalid.*wieght"):
        canonical_swap({"basic_arithmetic": {"name": "math_exact", "wieght": 2}}, task, tmp_path)
    mixed = TaskConfig(mixture={"basic_arithmetic": 1, "chain_sum": 1})
    with pytest.raises(RewardSwapError, match=r"mixes tasks \['basic_arithmetic', 'chain_sum'\]"):
        canonical_swap("math_exact", mixed, tmp_path)
    with pytest.raises(RewardSwapError, match="unknown reward 'math_exakt'|'math_exakt'"):
        check_swap(canonical_swap("math_exakt", task, tmp_path), task)
    with pytest.raises(RewardSwapError, match="reward 'humaneval' does not fit task 'basic_arithmetic'"):
        check_swap(canonical_swap("humaneval", task, tmp_path), task)
    with pytest.raises(RewardSwapError, match=f"file {tmp_path / 'missing.py'} does not exist"):
        check_swap(canonical_swap({"function": "missing.py:score"}, task, tmp_path), task)
    # a relative file.py becomes absolute against the CLI's directory; a list is a weighted sum
    (tmp_path / "r.py").write_text("def score(completions, **kw):\n    return [1.0 for _ in completions]\n")
    swap = canonical_swap(parse_swap_config("[{function: r.py:score, weight: 0.5}, math_exact]", tmp_path), task,
                          tmp_path)
    assert swap == {TASK: [{"function": f"{tmp_path / 'r.py'}:score", "weight": 0.5}, {"name": "math_exact"}]}
    assert check_swap(swap, task)[TASK].startswith("0.5*fn:r.py:score:")


def test_the_cli_refuses_a_bad_swap_before_reaching_the_run(tmp_path, monkeypatch, capsys):
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "recipe.json").write_text(json.dumps({"task": TaskConfig().model_dump(mode="json")}))
    reached = []
    monkeypatch.setattr(ops, "connect", lambda *a: reached.append(a))
    code = cli.main(["reward", "swap", "--run", "r", "--run-dir", str(tmp_path), "{name: math_exakt}"])
    out = " ".join(capsys.readouterr().out.split())
    assert code == 2 and "math_exakt" in out and reached == [], out
    (tmp_path / "swap.yaml").write_text("basic_arithmetic: {function: nowhere.py:score}")
    monkeypatch.chdir(tmp_path)
    code = cli.main(["reward", "swap", "--run", "r", "--run-dir", str(tmp_path), "swap.yaml"])
    out = "".join(capsys.readouterr().out.split())
    assert code == 2 and "".join(f"file {tmp_path / 'nowhere.py'} does not exist".split()) in out, out
    assert reached == []
    assert Path(tmp_path / "r" / SWAP_JOURNAL).exists() is False


def test_a_swap_to_a_reward_model_is_checked_and_its_folder_made_absolute(tmp_path, tiny_classifier, tiny_llama,
                                                                          monkeypatch):
    import shutil

    with pytest.raises(RewardSwapError, match="this run has no reward-model service"):
        check_swap(canonical_swap({"model": str(tiny_classifier)}, TaskConfig(), tmp_path), TaskConfig())
    task = TaskConfig(rewards=[{"model": str(tiny_classifier)}, {"name": "math_exact"}])  # a run with the service
    shutil.copytree(tiny_classifier, tmp_path / "rm-v2")
    swap = canonical_swap(parse_swap_config("{model: rm-v2, weight: 2.0}", tmp_path), task, tmp_path)
    assert swap == {TASK: [{"model": str(tmp_path / "rm-v2"), "weight": 2.0}]}
    assert check_swap(swap, task)[TASK].startswith("rm:classifier:rm-v2@") or \
        check_swap(swap, task)[TASK].startswith("2*rm:classifier:rm-v2@")
    with pytest.raises(RewardSwapError, match="not a sequence classifier"):  # a causal LM: refused before the run
        check_swap(canonical_swap({"model": str(tiny_llama)}, task, tmp_path), task)
