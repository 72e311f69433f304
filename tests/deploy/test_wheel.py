"""gyre as a wheel: built from the tracked files, installed beside proto-plus, imported from outside the checkout.

proto-plus (in every runtime lock: ray[default] -> opencensus -> google-api-core) owns the top-level ``proto``
package. The wheel must install exactly one top-level name, ``gyre``, so neither package shadows or overwrites the
other; ``gyre --help`` and ``gyre run --dry-run`` must then work from a directory that is not the checkout.

The fresh venv gets the dev venv's site-packages as a plain path entry (its ``.pth`` files, gyre's editable finder
among them, are not processed), so the wheel's own ``gyre`` is the only one importable and nothing is downloaded.
"""

from __future__ import annotations

import os
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _run(cmd, **kw):
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)
    assert out.returncode == 0, f"{cmd} exited {out.returncode}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built (no isolation, no network) from a copy of the tracked and untracked-not-ignored files."""
    src = tmp_path_factory.mktemp("src")
    listed = _run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO).stdout
    for rel in filter(None, listed.split("\0")):
        path = REPO / rel
        if path.is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            (src / rel).write_bytes(path.read_bytes())
    dist = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist), str(src)])
    (built,) = dist.glob("gyre-*.whl")
    return built


def test_the_wheel_installs_one_top_level_name_and_no_proto(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert top == {"gyre"}, f"the wheel installs top-level {sorted(top)}; expected only gyre (proto-plus owns proto/)"
    for expected in ("gyre/proto/trajectory.py", "gyre/proto/replay_pb2_grpc.py", "gyre/services/cli/main.py",
                     "gyre/utils/retry.py", "gyre/deploy/recipes/smollm2-arith.yaml"):
        assert expected in names, f"{expected} missing from {wheel.name}"


def test_the_installed_wheel_runs_beside_proto_plus_from_outside_the_checkout(wheel, tmp_path):
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    py = venv / "bin" / "python"
    own_site = Path(_run([str(py), "-c", "import site; print(site.getsitepackages()[0])"]).stdout.strip())
    (own_site / "dev-venv.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    _run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(own_site), str(wheel)])
    scripts = own_site / "bin"
    away = tmp_path / "elsewhere"
    away.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"HF_HUB_OFFLINE": "1"}

    probe = _run([str(py), "-c", (
        "import importlib.util as u, proto, gyre.proto.trajectory as t, gyre.proto.replay_pb2_grpc as g\n"
        "print(u.find_spec('proto').origin); print(t.__file__); print(hasattr(proto, 'Message'))")],
        cwd=away, env=env).stdout.split()
    assert probe[0].startswith(site.getsitepackages()[0]) and probe[0].endswith("proto/__init__.py"), probe
    assert probe[1].startswith(str(own_site / "gyre" / "proto")), f"gyre imported from {probe[1]}, not the wheel"
    assert probe[2] == "True", "`import proto` is not proto-plus"

    gyre = [str(py), str(scripts / "gyre")] if (scripts / "gyre").exists() else [str(py), "-m", "gyre.services.cli"]
    assert "run" in _run([*gyre, "--help"], cwd=away, env=env).stdout
    recipe = REPO / "deploy" / "recipes" / "smollm2-arith.yaml"
    dry = _run([*gyre, "run", str(recipe), "--dry-run", "--set", "model=org/any", "--set", f"run_dir={tmp_path}"],
               cwd=away, env=env)
    assert "learner" in dry.stdout + dry.stderr
