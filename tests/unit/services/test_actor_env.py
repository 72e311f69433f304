"""What every service process inherits from the driver: the checkout on its import path (a node or a job's
working-dir copy imports gyre from there) and DeepSpeed's op cache under the checkout's .cache."""

import os
from pathlib import Path

from gyre.services.control.orchestration.controller import actor_env

REPO = Path(__file__).resolve().parents[3]


def test_actors_import_gyre_from_the_checkout_root(monkeypatch):
    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    env = actor_env()
    assert env["PYTHONPATH"].split(os.pathsep) == [str(REPO)]
    assert (Path(env["PYTHONPATH"]) / "services" / "__init__.py").is_file()
    assert env["TORCH_EXTENSIONS_DIR"] == str(REPO / ".cache/torch_extensions")


def test_a_driver_pythonpath_is_kept_after_the_checkout(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/opt/extra")
    assert actor_env()["PYTHONPATH"].split(os.pathsep) == [str(REPO), "/opt/extra"]


def test_grpc_fork_handlers_are_off_in_every_service_unless_the_driver_sets_them(monkeypatch):
    """A rollout forks harness and sandbox children while its gRPC channels are live (grpc/grpc#43055)."""
    monkeypatch.delenv("GRPC_ENABLE_FORK_SUPPORT", raising=False)
    assert actor_env()["GRPC_ENABLE_FORK_SUPPORT"] == "false"
    monkeypatch.setenv("GRPC_ENABLE_FORK_SUPPORT", "true")
    assert actor_env()["GRPC_ENABLE_FORK_SUPPORT"] == "true"

