"""rollout.dataset_source / dataset_files: a recipe's own data through Hugging Face ``datasets`` — each local
format loads, columns map onto prompts and reward entries, prompt index → row is deterministic (every row once
per epoch), held-out rows never train, too-long prompts are skipped and counted, bad inputs are named."""

from __future__ import annotations

import json
import subprocess
import sys

import datasets
import pandas as pd
import pytest

from gyre.rollout.dataset_files import DatasetConfig, DatasetError
from gyre.rollout.dataset_source import DatasetSource, PromptBudget
from gyre.rollout.tasks import TaskConfig, TaskSource
from tests.tiny_model import REPO, SMOLLM2_DIR

ROWS = [{"problem": f"What is {i} + 1?", "solution": str(i + 1), "level": i % 3} for i in range(12)]


def write_jsonl(path, rows=ROWS):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def source(path, heldout_size=2, budget=None, **cfg):
    cfg.setdefault("columns", {"prompt": "problem", "answer": "solution"})
    return DatasetSource("mine", DatasetConfig(path=str(path), **cfg), seed=3, heldout_seed=7,
                         heldout_size=heldout_size, budget=budget)


def all_entries(src):
    return sorted([src.train(i) for i in range(src.num_train_rows)] + src.heldout(), key=lambda e: e["level"] * 100
                  + int(e["solution"]))


@pytest.mark.parametrize("kind", ["jsonl", "json", "parquet", "csv", "disk", "disk_dict", "folder", "glob"])
def test_each_local_format_loads_every_row_with_every_column(tmp_path, kind):
    frame = pd.DataFrame(ROWS)
    if kind in ("jsonl", "json"):
        path = write_jsonl(tmp_path / f"d.{kind}")
    elif kind == "parquet":
        frame.to_parquet(path := tmp_path / "d.parquet")
    elif kind == "csv":
        frame.to_csv(path := tmp_path / "d.csv", index=False)
    elif kind in ("folder", "glob"):
        (tmp_path / "parts").mkdir()
        write_jsonl(tmp_path / "parts" / "a.jsonl", ROWS[:5])
        write_jsonl(tmp_path / "parts" / "b.jsonl", ROWS[5:])
        path = tmp_path / "parts" if kind == "folder" else tmp_path / "parts" / "*.jsonl"
    else:
        ds = datasets.Dataset.from_list(ROWS)
        (datasets.DatasetDict(train=ds, test=ds.select(range(3))) if kind == "disk_dict" else ds).save_to_disk(
            path := tmp_path / "saved")
    src = source(path)
    assert src.num_train_rows == 10 and len(src.heldout()) == 2
    entries = all_entries(src)
    # csv reads the answers back as ints (the rewards compare str(answer))
    assert [(e["problem"], str(e["solution"]), e["level"]) for e in entries] == \
        [(r["problem"], r["solution"], r["level"]) for r in sorted(ROWS, key=lambda r: r["level"] * 100
                                                                     + int(r["solution"]))]
    assert all(e["question"] == e["problem"] and e["answer"] == e["solution"] for e in entries)


def test_string_and_chat_prompts_become_messages_and_every_column_reaches_the_reward(tmp_path):
    path = write_jsonl(tmp_path / "chat.jsonl", [
        {"msgs": [{"role": "user", "content": f"Add {i} and 1."}], "ref": str(i + 1), "id": f"r{i}"}
        for i in range(4)] + [{"msgs": [{"role": "system", "content": "Own."}, {"role": "user", "content": "Hi"}],
                               "ref": "0", "id": "sys"}])
    task = TaskSource(TaskConfig(dataset={"path": str(path), "columns": {"prompt": "msgs", "answer": "ref"}},
                                 heldout_size=1, system_prompt="Be brief."))
    problems = [task.problem(i) for i in range(4)] + task.heldout()
    by_id = {p.entry["id"]: p for p in problems}
    assert sorted(by_id) == ["r0", "r1", "r2", "r3", "sys"] and {p.task for p in problems} == {"dataset"}
    assert task.messages(by_id["r2"]) == [{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "Add 2 and 1."}]
    assert task.messages(by_id["sys"]) == [{"role": "system", "content": "Own."}, {"role": "user", "content": "Hi"}]
    entry = by_id["r2"].entry
    assert entry["question"] == "Add 2 and 1." and entry["answer"] == "3" and entry["id"] == "r2"
    math_exact = task.reward_for("dataset").parts[0].reward  # the default reward reads the mapping
    assert math_exact.name == "math_exact" and math_exact.score("so \\boxed{3}", entry).reward == 1.0
    text = TaskSource(TaskConfig(dataset={"path": str(write_jsonl(tmp_path / "t.jsonl")),
                                          "columns": {"prompt": "problem", "answer": "solution"}},
                                 heldout_size=1, system_prompt="S."))
    assert text.messages(text.problem(0)) == [{"role": "system", "content": "S."},
                                              {"role": "user", "content": text.problem(0).entry["problem"]}]


def test_prompt_index_maps_to_the_same_row_in_every_instance_and_process_and_each_row_once_per_epoch(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl")
    a, b = source(path), source(path)
    n = a.num_train_rows
    rows = [a.row_of(i) for i in range(3 * n)]
    assert [b.row_of(i) for i in reversed(range(3 * n))] == rows[::-1]  # any order, any instance
    epochs = [rows[e * n:(e + 1) * n] for e in range(3)]
    assert all(sorted(ep) == sorted(epochs[0]) and len(set(ep)) == n for ep in epochs)  # every row once per epoch
    assert epochs[0] != epochs[1] != epochs[2]  # reshuffled per epoch
    code = (f"from gyre.rollout.dataset_files import DatasetConfig\nfrom gyre.rollout.dataset_source import DatasetSource\n"
            f"s = DatasetSource('mine', DatasetConfig(path={str(path)!r}, columns={{'prompt': 'problem'}}), 3, 7, 2)\n"
            f"print([s.row_of(i) for i in range({3 * n})])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == rows
    assert {a.row_of(i) for i in range(n)}.isdisjoint(a._heldout)  # held-out rows never get an index


def test_heldout_rows_never_train_fraction_file_and_default(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl")
    frac = source(path, heldout_size=100, eval={"heldout_fraction": 0.25, "seed": 5})
    train = {frac.train(i)["problem"] for i in range(frac.num_train_rows)}
    held = {e["problem"] for e in frac.heldout()}
    assert len(held) == 3 and len(train) == 9 and not train & held
    again = source(path, heldout_size=100, eval={"heldout_fraction": 0.25, "seed": 5})
    assert {e["problem"] for e in again.heldout()} == held  # seeded
    assert {e["problem"] for e in source(path, heldout_size=100,
                                         eval={"heldout_fraction": 0.25, "seed": 6}).heldout()} != held
    default = source(path, heldout_size=4)
    assert default.num_train_rows == 8 and not ({e["problem"] for e in default.heldout()}
                                                & {default.train(i)["problem"] for i in range(8)})
    test_file = write_jsonl(tmp_path / "test.jsonl", [{"problem": "Q?", "solution": "1", "level": 0}] * 3)
    separate = source(path, heldout_size=2, eval={"path": str(test_file)})
    assert separate.num_train_rows == 12 and [e["problem"] for e in separate.heldout()] == ["Q?", "Q?"]


def test_too_long_prompts_are_skipped_and_counted_and_never_get_an_index(tmp_path):
    rows = ROWS[:6] + [{"problem": "x" * 500, "solution": "0", "level": 9}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    budget = PromptBudget(lambda msgs: sum(len(m["content"]) for m in msgs), train_max=100, eval_max=100)
    src = source(path, heldout_size=1, budget=budget, eval={"heldout_fraction": 0.2, "seed": 1})
    assert src.num_train_rows + len(src.heldout()) == 6 and sum(src.too_long.values()) == 1
    assert all(len(src.train(i)["problem"]) < 100 for i in range(2 * src.num_train_rows))
    with pytest.raises(DatasetError, match="no train row left .* longer than the engine's context, 5 tokens"):
        source(path, heldout_size=1, budget=PromptBudget(lambda m: 50, 5, 100))


def test_the_tokenizer_budget_counts_exactly_where_the_byte_bound_does_not_settle_it():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(SMOLLM2_DIR)
    calls = []
    real = tok.apply_chat_template

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    tok.apply_chat_template = counting
    budget = PromptBudget.for_tokenizer(tok, max_model_len=256, max_new_tokens=56, eval_max_new_tokens=16)
    assert (budget.train_max, budget.eval_max) == (200, 240)
    short = [{"role": "user", "content": "What is 2 + 2?"}]
    long = [{"role": "user", "content": "word " * 300}]
    exact = len(real(long, add_generation_prompt=True, tokenize=True)["input_ids"])
    calls.clear()
    assert budget.count_tokens(short) >= len(real(short, add_generation_prompt=True, tokenize=True)["input_ids"])
    assert calls == []  # a short prompt is accepted on its byte count alone
    assert budget.count_tokens(long) == exact > 200


@pytest.mark.parametrize("cfg, message", [
    ({"path": "{tmp}/nope.jsonl"}, "dataset path {tmp}/nope.jsonl does not exist"),
    ({"path": "{tmp}/d.jsonl", "columns": {"prompt": "question"}},
     "has no column 'question' (columns.prompt); its columns are ['problem', 'solution', 'level']"),
    ({"path": "{tmp}/d.jsonl", "columns": {"prompt": "problem", "answer": "ans"}},
     "has no column 'ans' (columns.answer); its columns are ['problem', 'solution', 'level']"),
    ({"path": "{tmp}/d.jsonl", "columns": {"prompt": "level"}}, "column 'level' (columns.prompt) must hold strings"),
    ({"path": "{tmp}/d.jsonl", "split": "test"}, "split 'test'"),
    ({"path": "{tmp}/saved", "split": "validation"}, "has no split 'validation'; its splits are ['test', 'train']"),
    ({"path": "{tmp}/empty.jsonl"}, "split 'train' has no rows (its files are empty)"),
    ({"path": "{tmp}/empty.parquet"}, "split 'train' has no rows (its files are empty)"),
    ({"path": "{tmp}/saved", "split": "test"}, "split 'test' has no rows"),
    ({"path": "{tmp}/d.jsonl", "eval": {"split": "train"}}, "eval.split ('train') is the training split"),
    ({"path": "no-such-org/no-such-data"}, "is not a local path and offline (HF_HUB_OFFLINE=1) and it is not in the "
                                           "local Hugging Face cache"),
])
def test_bad_datasets_are_refused_naming_the_value_and_what_was_expected(tmp_path, monkeypatch, cfg, message):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setattr("datasets.config.HF_HUB_OFFLINE", True)
    write_jsonl(tmp_path / "d.jsonl")
    ds = datasets.Dataset.from_list(ROWS)
    datasets.DatasetDict(train=ds, test=ds.filter(lambda r: False)).save_to_disk(tmp_path / "saved")
    (tmp_path / "empty.jsonl").write_text("\n")
    pd.DataFrame({"problem": pd.Series([], dtype=str)}).to_parquet(tmp_path / "empty.parquet")
    cfg = json.loads(json.dumps(cfg).replace("{tmp}", str(tmp_path)))
    cfg.setdefault("columns", {"prompt": "problem"})
    with pytest.raises(DatasetError) as err:
        DatasetSource("mine", DatasetConfig(**cfg), seed=3, heldout_seed=7, heldout_size=2)
    assert message.replace("{tmp}", str(tmp_path)) in str(err.value)


def test_dataset_config_refuses_ambiguous_forms():
    with pytest.raises(ValueError, match="set either dataset or \\['name'\\], not both"):
        TaskConfig(name="countdown", dataset={"path": "x.jsonl"})
    with pytest.raises(ValueError, match="eval needs either path/split .* or heldout_fraction, not both"):
        DatasetConfig(path="x.jsonl", eval={"split": "test", "heldout_fraction": 0.1})
    with pytest.raises(ValueError, match="not neither"):
        DatasetConfig(path="x.jsonl", eval={"seed": 3})


def test_a_rollout_worker_generates_dataset_prompts_from_their_messages_and_counts_skipped_ones(tmp_path):
    import asyncio

    from gyre.replay.buffer import TrajectoryBuffer
    from gyre.replay.config import ReplayConfig
    from gyre.rollout.config import RolloutConfig, SamplingConfig
    from gyre.rollout.worker import RolloutWorker
    from tests.fakes import FakeEngine, FakeReplay, FakeTokenizer, until

    rows = ROWS + [{"problem": "y" * 300, "solution": "0", "level": 7}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    budget = PromptBudget(lambda msgs: sum(len(m["content"]) for m in msgs), train_max=100, eval_max=100)
    task = TaskSource(TaskConfig(dataset={"path": str(path), "name": "mine",
                                          "columns": {"prompt": "problem", "answer": "solution"}},
                                 heldout_size=2, system_prompt="S."), budget)
    config = RolloutConfig.model_construct(engine=None, sampling=SamplingConfig(), group_size=2, groups_in_flight=2,
                                           max_ready_groups=4, retry_backoff_s=0.01,
                                           num_workers=1)
    buf = TrajectoryBuffer(ReplayConfig())
    worker = RolloutWorker("r0", config, task, FakeEngine(["12"]), FakeReplay(buf), FakeTokenizer(), seed=3)
    assert worker.stats.prompts_too_long == task.too_long() == 1
    assert worker.stats.as_dict(0)["prompts_too_long"] == 1

    async def run():
        job = asyncio.create_task(worker.run())
        await until(lambda: job.done() or buf.info()["size_groups"] >= 4, "4 groups in replay")
        worker.stop()
        await job
        return (await worker.evaluate()).metrics

    result = asyncio.run(run())
    _, table = buf.sample(4, learner_version=0)
    for row in table.to_pylist():
        problem = task.problem(row["prompt_index"])
        assert row["task"] == "mine" and row["prompt_token_ids"] == [2, len(problem.entry["problem"])]
        assert row["reward"] == float(problem.entry["solution"] == "12")
    assert result["heldout_size"] == 2


def test_a_mixture_component_takes_a_dataset_beside_a_reasoning_gym_task(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl")
    task = TaskSource(TaskConfig(mixture={
        "mine": {"weight": 1, "dataset": {"path": str(path), "columns": {"prompt": "problem", "answer": "solution"}}},
        "basic_arithmetic": 1}, heldout_size=2))
    problems = [task.problem(i) for i in range(40)]
    assert {p.task for p in problems} == {"mine", "basic_arithmetic"}
    mine = [p for p in problems if p.task == "mine"]
    assert all(task.messages(p) == [{"role": "user", "content": p.entry["problem"]}] for p in mine)  # no suffix
    assert task.reward_versions()["mine"] == "math-exact-v1" and [p.task for p in task.heldout()].count("mine") == 2
