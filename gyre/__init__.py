"""gyre: asynchronous RL post-training for LLMs as independent, crash-tolerant services.

The import name of the whole project. Its packages live in the repository's top-level folders and are mapped
under this name by ``setup.py`` (setuptools ``package_dir``), so code imports ``gyre.proto.trajectory``,
``gyre.learner.engine`` or ``gyre.services.cli.main`` and never a bare ``proto`` (``proto-plus``, which Ray
installs, owns that top-level name). The folders: ``services/`` (the processes and their supervision),
``proto/`` (the contracts), ``utils/`` (ground-level helpers), ``learner/``, ``rollout/``, ``replay/`` (the
cores), ``deploy/`` (cluster launchers, model preparation) and ``faults/`` (fault points for crash tests).

Installed (a wheel, or ``pip install -e .``), the mapping is setuptools'. A checkout that is only on
``PYTHONPATH`` (a lent GPU machine with no install step, ``bench/gpu_check.sh``) resolves the same names: this
package's search path then also holds the checkout's root, where the folders are.
"""

import os
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

# gRPC's fork handlers restart its poller in a child that `subprocess` forks from a process with live channels, and
# the child can abort before `exec` (grpc/grpc#43055, grpcio >= 1.80): seen as `gyre sweep`'s runs, verifiers
# harnesses and sandboxed rewards exiting -6. gyre never uses a channel across a fork, so every process that imports
# gyre before it first uses gRPC turns them off (Ray actors get it in their environment: `actor_env`).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

_here = Path(__file__).resolve().parent
if not (_here / "proto").is_dir() and (_here.parent / "proto" / "trajectory.py").is_file():
    __path__.append(str(_here.parent))  # a source checkout: gyre.proto is <checkout>/proto

try:
    __version__ = version("gyre")
except PackageNotFoundError:  # a source tree on PYTHONPATH, not installed
    __version__ = "0+unknown"
