"""Running the controller with a chaos thread beside it (the e2e restart tests)."""

from __future__ import annotations

import threading

import ray
from ray._private import auto_init_hook

from gyre.services.control.orchestration import controller


def run_with_chaos(recipe, chaos: threading.Thread, monkeypatch) -> dict:
    """``controller.run(recipe)`` while ``chaos`` (a thread with a ``stop`` event) kills services; Ray's
    shutdown first stops and joins ``chaos`` (touching Ray after shutdown would end the process), and a late
    chaos call cannot start a Ray of its own. Returns the run's summary."""
    monkeypatch.setattr(auto_init_hook, "enable_auto_connect", False)
    real_shutdown = ray.shutdown

    def shutdown_after_chaos():
        chaos.stop.set()
        chaos.join(timeout=60)
        real_shutdown()

    monkeypatch.setattr(controller.ray, "shutdown", shutdown_after_chaos)
    chaos.start()
    return controller.run(recipe)
