"""Rewards as plain Python functions (TRL's calling convention), loaded from files and modules gyre has never
seen, scored through the rollout worker's real path; weighted sums; failures recorded, never fatal."""

import asyncio
import sys
import textwrap

import pytest

from gyre.rollout.rewards.combined import make_reward_set
from gyre.rollout.rewards.function import Group, RewardImportError
from gyre.rollout.rewards.scoring import score_groups
from gyre.rollout.tasks import TaskConfig, TaskSource
from gyre.rollout.stats import merge_reward_means
from tests.fakes import FakeEngine
from tests.unit.rollout.test_rewards_hotswap import TINY, make_worker


def write(path, source):
    path.write_text(textwrap.dedent(source))
    return path


def rows_of(task, texts, prompt_index=0):
    """Rows the worker builds for one group (group size 2) answered with ``texts``, and the worker."""
    worker, delivered = make_worker(task, FakeEngine(texts))
    asyncio.run(worker._one_group(prompt_index, 0))
    return delivered[0], worker


def score(spec_or_configs, completions, entry=None, **config):
    configs = spec_or_configs if isinstance(spec_or_configs, list) else [{"function": spec_or_configs, **config}]
    rewards = make_reward_set(configs)
    group = Group(list(completions), [[{"role": "user", "content": "q"}]] * len(completions),
                  entry or {"answer": "5"}, [[1]] * len(completions))
    return rewards, asyncio.run(score_groups([(rewards, group)]))[0]


def test_a_file_function_is_called_once_per_group_with_trl_arguments(tmp_path):
    path = write(tmp_path / "reward.py", """
        CALLS = []

        def score(completions, *, prompts, answer, **columns):
            CALLS.append(dict(columns, completions=completions, prompts=prompts, answer=answer))
            return [1.0 if c.strip() == a else -0.5 for c, a in zip(completions, answer)]
    """)
    task = TaskSource(TaskConfig(params=TINY, heldout_size=4, reward={"function": f"{path}:score"}))
    problem = task.problem(0)
    rows, _ = rows_of(task, [problem.entry["answer"], "nope"])
    assert [(r["reward"], r["reward_error"]) for r in rows] == [(1.0, ""), (-0.5, "")]
    version = rows[0]["reward_fn_version"]
    assert version.startswith("fn:reward.py:score:") and len(version) == len("fn:reward.py:score:") + 12
    (call,) = task.reward_for(problem.task).parts[0].reward.fn.__globals__["CALLS"]
    assert call["completions"] == [problem.entry["answer"], "nope"]
    assert call["prompts"] == [task.messages(problem)] * 2  # the chat messages each completion answered
    assert call["answer"] == [problem.entry["answer"]] * 2  # every entry column, one value per completion
    assert call["question"] == [problem.entry["question"]] * 2 and call["metadata"] == [problem.entry["metadata"]] * 2
    assert call["completion_ids"] == [[5, 6], [5, 6]]  # FakeEngine's token ids


def test_an_async_function_is_awaited_off_the_rollout_loop(tmp_path):
    path = write(tmp_path / "areward.py", """
        import asyncio
        import threading

        async def score(completions, prompts, **columns):
            await asyncio.sleep(0)
            return [float(len(c)) if threading.current_thread().name == "gyre-reward-async" else -1.0
                    for c in completions]
    """)
    task = TaskSource(TaskConfig(params=TINY, heldout_size=4, reward={"function": f"{path}:score"}))
    rows, _ = rows_of(task, ["abc", "de"])
    assert [(r["reward"], r["reward_error"]) for r in rows] == [(3.0, ""), (2.0, "")]


@pytest.mark.parametrize("body, expected", [
    ("return [1.0]", [(0.0, "returned: 1 scores for 2 completions")] * 2),
    ("return 1.0", [(0.0, "returned: float, expected a list of 2 floats or None")] * 2),
    ("return ['yes', 0.25]", [(0.0, "returned: str 'yes', not a number"), (0.25, "")]),
    ("return [None, True]", [(0.0, "returned: None (no verdict)"), (1.0, "")]),
    ("return [float('nan'), 2]", [(0.0, "returned: nan, not finite"), (2.0, "")]),
    ("raise ValueError('boom ' + answer[0])", [(0.0, "raised: ValueError: boom 5")] * 2),
])
def test_a_bad_result_is_a_failed_score_on_the_rows_it_concerns(tmp_path, body, expected):
    path = write(tmp_path / "bad.py", f"def score(completions, answer, **kw):\n    {body}\n")
    _, got = score(f"{path}:score", ["a", "b"])
    assert [(r.reward, r.error) for r in got.results] == expected


def test_a_function_past_its_timeout_is_a_failed_score(tmp_path):
    path = write(tmp_path / "slow.py", """
        import asyncio
        import threading

        RELEASE = threading.Event()

        def blocking(completions, **kw):
            RELEASE.wait(30)
            return [1.0] * len(completions)

        async def sleeping(completions, **kw):
            await asyncio.sleep(30)
            return [1.0] * len(completions)
    """)
    rewards, got = score(f"{path}:blocking", ["a", "b"], timeout_s=0.2)
    rewards.parts[0].reward.fn.__globals__["RELEASE"].set()  # let the pool thread go
    assert [(r.reward, r.error) for r in got.results] == [(0.0, "timeout: not scored within 0.2 s")] * 2
    _, got = score(f"{path}:sleeping", ["a"], timeout_s=0.2)
    assert [(r.reward, r.error) for r in got.results] == [(0.0, "timeout: not scored within 0.2 s")]


def test_weighted_rewards_are_summed_over_the_rewards_that_scored_the_row(tmp_path):
    # TRL's nansum: a function's None (no verdict) leaves the row to the other rewards. Before #39 it failed the
    # whole row (reward 0, reward_error), so one abstaining function silenced every other reward.
    path = write(tmp_path / "parts.py", """
        def length(completions, **kw):
            return [None if "boxed" in c else 0.1 * len(c) for c in completions]
    """)
    task = TaskSource(TaskConfig(params=TINY, heldout_size=4, rewards=[
        {"name": "math_exact", "weight": 0.5}, {"function": f"{path}:length", "weight": 2.0}]))
    answer = task.problem(0).entry["answer"]
    rows, worker = rows_of(task, [f"\\boxed{{{answer}}}", "oops"])
    fn_version = task.reward_for("basic_arithmetic").parts[1].reward.version
    assert rows[0]["reward_fn_version"] == f"0.5*math-exact-v1+2*{fn_version}"
    assert (rows[0]["reward"], rows[0]["reward_error"]) == (0.5 * 1.0, "")  # length abstained: math_exact alone
    assert rows[1]["reward"] == pytest.approx(2.0 * 0.1 * len("oops")) and rows[1]["reward_error"] == ""
    stats = worker.stats.as_dict(0)
    assert stats["reward_errors"] == 0
    assert stats["reward_counts"] == {"basic_arithmetic/parts.py:length": 1, "basic_arithmetic/math_exact": 2}
    assert stats["reward_means"]["basic_arithmetic/math_exact"] == 0.5  # the boxed answer right, "oops" wrong
    assert stats["reward_means"]["basic_arithmetic/parts.py:length"] == pytest.approx(0.1 * len("oops"))
    other = {"reward_counts": {"basic_arithmetic/math_exact": 6}, "reward_means": {"basic_arithmetic/math_exact": 1.0}}
    merged = merge_reward_means([stats, other, {}])  # the controller's rollout_reward_means in metrics.jsonl
    assert merged["basic_arithmetic/math_exact"] == pytest.approx((2 * 0.5 + 6 * 1.0) / 8)
    assert merged["basic_arithmetic/parts.py:length"] == stats["reward_means"]["basic_arithmetic/parts.py:length"]


def test_a_row_no_reward_scored_or_one_reward_failed_on_is_a_failed_score(tmp_path):
    path = write(tmp_path / "parts.py", """
        def abstain(completions, **kw):
            return [None] * len(completions)

        def picky(completions, **kw):
            return [None if c == "a" else 1.0 for c in completions]

        def brittle(completions, **kw):
            if "b" in completions:
                raise ValueError("cannot read b")
            return [1.0] * len(completions)
    """)
    _, got = score([{"function": f"{path}:abstain"}, {"function": f"{path}:picky", "weight": 2.0}], ["a", "c"])
    assert [(r.reward, r.error) for r in got.results] == [
        (0.0, "parts.py:abstain: returned: None (no verdict); parts.py:picky: returned: None (no verdict)"),
        (2.0, "")]
    _, got = score([{"function": f"{path}:picky"}, {"function": f"{path}:brittle"}], ["a", "b"])
    assert [(r.reward, r.error) for r in got.results] == [(0.0, "parts.py:brittle: raised: ValueError: cannot read b")] * 2


def test_reward_functions_copied_from_trls_documentation_run_unchanged(tmp_path):
    # TRL's GRPOTrainer docs ("Using a custom reward function"): a conversational format reward (completions are
    # lists of messages for conversational data) and a standard one taking a dataset column by keyword. Before
    # #39 gyre passed strings whatever the data, so the first raised "string indices must be integers".
    path = write(tmp_path / "trl_rewards.py", r"""
        import re

        def format_reward_func(completions, **kwargs):
            "Reward function that checks if the completion has a specific format."
            pattern = r"^<think>.*?</think><answer>.*?</answer>$"
            completion_contents = [completion[0]["content"] for completion in completions]
            matches = [re.match(pattern, content) for content in completion_contents]
            return [1.0 if match else 0.0 for match in matches]

        def reward_func(completions, ground_truth, **kwargs):
            # Regular expression to capture content inside oxed{}
            matches = [re.search(r"\\boxed\{(.*?)\}", completion) for completion in completions]
            contents = [match.group(1) if match else "" for match in matches]
            # Reward 1 if the content is the same as the ground truth, 0 otherwise
            return [1.0 if c == gt else 0.0 for c, gt in zip(contents, ground_truth)]
    """)
    conversational = {"prompt": [{"role": "user", "content": "What is 2 + 3?"}], "ground_truth": "5"}
    _, got = score(f"{path}:format_reward_func", ["<think>2+3</think><answer>5</answer>", "5"], conversational)
    assert [(r.reward, r.error) for r in got.results] == [(1.0, ""), (0.0, "")]
    standard = {"prompt": "What is 2 + 3?", "ground_truth": "5"}
    _, got = score(f"{path}:reward_func", ["so \\boxed{5}", "\\boxed{6}"], standard)
    assert [(r.reward, r.error) for r in got.results] == [(1.0, ""), (0.0, "")]


def test_every_argument_is_passed_by_keyword_as_trl_does(tmp_path):
    # TRL calls reward_func(prompts=..., completions=..., completion_ids=..., **columns): a function that lists
    # prompts first binds. gyre passed completions positionally, into `prompts`.
    path = write(tmp_path / "order.py", """
        def score(prompts, completions, **kwargs):
            return [float(p[-1]["content"] == "q" and isinstance(c, str)) for p, c in zip(prompts, completions)]
    """)
    _, got = score(f"{path}:score", ["a", "b"])
    assert [(r.reward, r.error) for r in got.results] == [(1.0, ""), (1.0, "")]


def test_a_changed_source_or_params_is_a_new_version_and_swap_reward_loads_it(tmp_path):
    path = write(tmp_path / "swap.py", "def score(completions, **kw):\n    return [0.0] * len(completions)\n")
    task = TaskSource(TaskConfig(params=TINY, heldout_size=4, reward={"function": f"{path}:score"}))
    old = task.reward_versions()["basic_arithmetic"]
    assert task.swap_reward({"function": f"{path}:score"}) == {"basic_arithmetic": old}  # same code: same version
    write(path, "def score(completions, **kw):\n    return [1.0] * len(completions)\n")
    new = task.swap_reward({"function": f"{path}:score"})["basic_arithmetic"]
    assert new != old and new.startswith("fn:swap.py:score:")
    rows, _ = rows_of(task, ["x"])
    assert [(r["reward"], r["reward_fn_version"]) for r in rows] == [(1.0, new)] * 2
    with_params = task.swap_reward({"function": f"{path}:score", "params": {}})["basic_arithmetic"]
    assert with_params == new
    write(path, "def score(completions, scale, **kw):\n    return [scale] * len(completions)\n")
    v2 = task.swap_reward({"function": f"{path}:score", "params": {"scale": 2.0}})["basic_arithmetic"]
    v3 = task.swap_reward({"function": f"{path}:score", "params": {"scale": 3.0}})["basic_arithmetic"]
    assert len({old, new, v2, v3}) == 4
    rows, _ = rows_of(task, ["x"])
    assert [r["reward"] for r in rows] == [3.0, 3.0]


def test_a_module_function_is_imported_and_reloaded_when_its_file_changes(tmp_path, monkeypatch):
    pkg = tmp_path / "gyre_test_rewards_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    write(pkg / "scores.py", "def score(completions, **kw):\n    return [0.25] * len(completions)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "gyre_test_rewards_pkg.scores", raising=False)
    spec = "gyre_test_rewards_pkg.scores:score"
    rewards, got = score(spec, ["a"])
    assert rewards.version.startswith(f"fn:{spec}:") and got.results[0].reward == 0.25
    write(pkg / "scores.py", "def score(completions, **kw):\n    return [0.75] * len(completions)\n")
    rewards2, got = score(spec, ["a"])
    assert rewards2.version != rewards.version and got.results[0].reward == 0.75
    monkeypatch.delitem(sys.modules, "gyre_test_rewards_pkg.scores")


@pytest.mark.parametrize("source, spec, message", [
    (None, "{dir}/missing.py:score", "file {dir}/missing.py does not exist"),
    (None, "gyre_no_such_module.rewards:score", "module 'gyre_no_such_module.rewards' does not import: "
                                                 "ModuleNotFoundError"),
    ("import gyre_no_such_module\n", "{dir}/r.py:score", "importing {dir}/r.py raised ModuleNotFoundError"),
    ("def other(completions, **kw):\n    return []\n", "{dir}/r.py:score",
     "has no attribute 'score' (its callables: other)"),
    ("score = 3\n", "{dir}/r.py:score", "'score' is a int, not callable"),
    ("def score():\n    return []\n", "{dir}/r.py:score", "score() cannot be called as fn(completions=..., prompts=...)"),
    ("def score(completions):\n    return []\n", "{dir}/r.py:score", "got an unexpected keyword argument 'prompts'"),
    (None, "{dir}/r.py", "not of the form target:function"),
])
def test_a_reward_that_does_not_load_is_refused_naming_its_path(tmp_path, source, spec, message):
    if source is not None:
        write(tmp_path / "r.py", source)
    spec, message = spec.format(dir=tmp_path), message.format(dir=tmp_path)
    with pytest.raises(RewardImportError) as err:
        make_reward_set([{"function": spec}])
    assert message in str(err.value)
    assert f"reward function {spec!r}" in str(err.value) and "expected 'pkg.module:fn' or" in str(err.value)


def test_a_signature_that_cannot_take_the_columns_is_refused_when_the_source_is_built(tmp_path):
    path = write(tmp_path / "narrow.py", "def score(completions, prompts):\n    return [1.0] * len(completions)\n")
    with pytest.raises(ValueError, match=r"reward 'narrow.py:score' does not fit task 'basic_arithmetic': "
                                         r"reward function '.*/narrow.py:score': score\(completions, prompts\) cannot take .*\['answer', 'metadata', "
                                         r"'question'\].*add \*\*kwargs"):
        TaskSource(TaskConfig(params=TINY, heldout_size=4, reward={"function": f"{path}:score"}))


def test_a_reward_sets_exactly_one_of_name_and_function():
    with pytest.raises(ValueError, match="exactly one of name .* and model"):
        TaskConfig(reward={"name": "math_exact", "function": "m:f"})
    with pytest.raises(ValueError, match="exactly one of name"):
        TaskConfig(reward={"params": {}})
    with pytest.raises(ValueError, match="set either reward or rewards"):
        TaskConfig(reward="math_exact", rewards=["math_exact"])
    with pytest.raises(ValueError, match="rewards must name at least one reward"):
        TaskConfig(rewards=[])
