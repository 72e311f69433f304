"""CPU sets per service (``placement.<role>.cpus``, ``services.common.cpus``): parsed and refused at recipe load,
handed by the factory to each instance as ``GYRE_CPUS`` + ``OMP_NUM_THREADS``, and applied in the actor process to
every thread (started before or after) and to torch's thread count."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from gyre.services.common.cpus import CPUS_ENV, CpuSetError, cpu_env, format_cpus, parse_cpus
from gyre.services.control.recipe.plan import describe
from gyre.services.control.recipe.schema import RecipeError, load_recipe
from gyre.services.control.orchestration.supervisor import ServiceFactory
from tests.unit.services.test_fault_arming import BASE_ENV, FakeActorClass, env_of

DEFAULT = "deploy/recipes/smollm2-arith.yaml"
TINY = "deploy/recipes/tiny-test.yaml"


@pytest.mark.parametrize("spec, ids", [("0", [0]), ("0-3", [0, 1, 2, 3]), ("8,0-2", [0, 1, 2, 8]),
                                       (" 1 , 3 ", [1, 3]), ("5-5", [5])])
def test_cpuset_lists_parse_and_format_back(spec, ids):
    assert parse_cpus(spec) == ids
    assert parse_cpus(format_cpus(ids)) == ids
    assert format_cpus([0, 1, 2, 3, 8, 10, 11]) == "0-3,8,10-11"


@pytest.mark.parametrize("spec, message", [
    ("", "is empty"), ("x", "'x' is not a CPU id or range"), ("-1", "'-1' is not a CPU id or range"),
    ("3-1", "range '3-1' ends below its start"), ("0,0-1", "names a CPU more than once"), ("1-x", "'1-x' is not"),
])
def test_bad_cpusets_are_named(spec, message):
    with pytest.raises(CpuSetError) as err:
        parse_cpus(spec)
    assert message in str(err.value) and repr(spec) in str(err.value)


def test_cpu_env_gives_the_set_and_its_thread_count():
    assert cpu_env(None) == {}
    assert cpu_env("2,0-1") == {CPUS_ENV: "0-2", "OMP_NUM_THREADS": "3"}
    assert cpu_env("1-") == {CPUS_ENV: "1-"}  # its size is the node's: the process sets OMP_NUM_THREADS


def test_an_open_range_is_every_allowed_cpu_from_its_start():
    assert parse_cpus("2-", allowed={0, 1, 2, 3, 5}) == [2, 3, 5]
    assert parse_cpus("0,2-", allowed={0, 1, 2, 3}) == [0, 2, 3]
    assert parse_cpus("1-") == [1]  # checking a recipe: the node is not known yet
    with pytest.raises(CpuSetError, match=r"cpus '4-': '4-' names no CPU here \(this process may use 0-1\)"):
        parse_cpus("4-", allowed={0, 1})
    with pytest.raises(CpuSetError, match="names a CPU more than once"):
        parse_cpus("0-,3", allowed={0, 1, 2, 3})


@pytest.mark.parametrize("placement, message", [
    ({"rollout": {"cpus": "1-0"}}, "placement.rollout: Value error, cpus '1-0': range '1-0' ends below its start"),
    ({"learner": {"cpus": []}}, "cpus [] is empty"),
    ({"replay": {"cpus": "all"}}, "cpus 'all': 'all' is not a CPU id or range"),
])
def test_bad_placement_cpus_are_refused_at_recipe_load(placement, message):
    with pytest.raises(RecipeError) as err:
        load_recipe(DEFAULT, {"placement": placement})
    assert message in str(err.value)


def test_each_instance_gets_its_cpuset_in_its_environment():
    recipe = load_recipe(TINY, {"run_dir": "/tmp/gyre-unit-runs", "rollout.num_workers": 3,
                                "placement": {"rollout": {"cpus": ["0", "1-2"]}, "learner": {"cpus": 3}}})
    assert recipe.placement.learner.cpus == "3"  # YAML's int is the set "3"
    factory = ServiceFactory(recipe, dict(BASE_ENV), "fp")
    cls = FakeActorClass()
    envs = [env_of(factory._create(cls, "rollout", f"rollout-{i}")) for i in range(3)]
    assert [(e[CPUS_ENV], e["OMP_NUM_THREADS"]) for e in envs] == [("0", "1"), ("1-2", "2"), ("0", "1")]
    learner = env_of(factory._create(cls, "learner", "learner"))
    assert (learner[CPUS_ENV], learner["OMP_NUM_THREADS"]) == ("3", "1")
    assert CPUS_ENV not in env_of(factory._create(cls, "replay", "replay"))  # unset: not pinned
    text = describe(recipe)
    assert "num_cpus=0 num_gpus=0 cpus=0|1-2" in text and "num_cpus=0 num_gpus=0 cpus=3" in text


PIN = textwrap.dedent("""
    import json, os, threading, time
    from gyre.services.common.cpus import pin_from_env
    stop = threading.Event()
    early = threading.Thread(target=stop.wait, daemon=True)  # a thread started before pinning (Ray's, gRPC's)
    early.start()
    ids = pin_from_env("learner")
    late = []
    t = threading.Thread(target=lambda: late.append(sorted(os.sched_getaffinity(0))))  # one started after
    t.start(); t.join()
    import torch
    tasks = {int(t): sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}
    print(json.dumps({"ids": ids, "early": tasks[early.native_id], "late": late[0],
                      "all": sorted({tuple(v) for v in tasks.values()}), "torch": torch.get_num_threads()}))
    stop.set()
""")


def _pin(cpus: str) -> subprocess.CompletedProcess:
    env = {**{k: v for k, v in os.environ.items() if k != CPUS_ENV}, **cpu_env(cpus)}
    return subprocess.run([sys.executable, "-c", PIN], env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU sets need Linux")
def test_pinning_binds_every_thread_and_sets_torchs_threads():
    mine = sorted(os.sched_getaffinity(0))
    done = _pin(str(mine[-1]))
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["ids"] == [mine[-1]] and out["early"] == [mine[-1]] and out["late"] == [mine[-1]]
    assert out["all"] == [[mine[-1]]]  # every thread of the process
    assert out["torch"] == 1
    if len(mine) > 1:  # an open range: every allowed CPU from its start; torch gets as many threads
        done = _pin(f"{mine[1]}-")
        out = json.loads(done.stdout.strip().splitlines()[-1])
        assert out["all"] == [mine[1:]] and out["torch"] == len(mine) - 1


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="CPU sets need Linux")
def test_a_cpu_the_process_may_not_use_is_refused_with_the_allowed_ones():
    allowed = format_cpus(sorted(os.sched_getaffinity(0)))
    done = _pin("4095")
    assert done.returncode != 0
    assert f"placement cpus '4095' for learner: CPU(s) 4095 are not available on this node " \
           f"(this process may use {allowed})" in done.stderr
