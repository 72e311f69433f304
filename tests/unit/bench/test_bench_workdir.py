"""``bench.workdir.run_quietly``: what a bench's services print goes to stderr, so stdout carries only the JSON
line; a temporary working folder is removed, a given one kept. And ``bench.time_to_accuracy``'s scale flags."""

import os
import subprocess
import sys

from bench.workdir import run_quietly


def test_output_inside_goes_to_stderr_and_a_temporary_folder_is_removed(capfd):
    seen = {}

    def measure(root):
        seen["root"] = root
        assert root.is_dir()
        os.write(1, b"service log line\n")  # a child process or a C library writes to fd 1
        return {"ok": 1}

    assert run_quietly(measure, None, "gyre-test-quiet-") == {"ok": 1}
    os.write(1, b"json line\n")
    out, err = capfd.readouterr()
    assert out == "json line\n" and "service log line" in err
    assert seen["root"].name.startswith("gyre-test-quiet-") and not seen["root"].exists()


def test_a_given_folder_is_kept_even_when_the_measurement_fails(tmp_path, capfd):
    def measure(root):
        (root / "partial.json").write_text("{}")
        raise RuntimeError("arm failed")

    try:
        run_quietly(measure, str(tmp_path), "unused-")
    except RuntimeError as exc:
        assert str(exc) == "arm failed"
    os.write(1, b"after\n")
    assert (tmp_path / "partial.json").exists() and capfd.readouterr().out == "after\n"  # fd 1 restored


def test_time_to_accuracy_refuses_steps_that_are_not_a_multiple_of_eval_every():
    done = subprocess.run([sys.executable, "-m", "bench.time_to_accuracy", "--steps", "25", "--eval-every", "10"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--steps 25 must be a positive multiple of --eval-every 10" in done.stderr
