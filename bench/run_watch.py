"""A thread beside ``controller.run`` that watches (and may SIGKILL parts of) the run: what the whole-run benches with
kills share (``bench.pipeline``, ``bench.fleet``)."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager


class RunWatcher:
    """Attaches to the run's ``ControllerState`` actor once the controller created it, then runs ``watch()``
    (subclasses); an error it raises is kept in ``error`` for the bench to report.

    Args:
        run: the recipe's name.
        namespace: the recipe's Ray namespace.
        attach_timeout_s: how long the controller may take to create its state actor.
    """

    def __init__(self, run: str, namespace: str, attach_timeout_s: float = 600.0) -> None:
        self.run_name, self.namespace, self.attach_timeout_s = run, namespace, attach_timeout_s
        self.state = None
        self.error: BaseException | None = None
        self.stop = threading.Event()
        """Set before the controller shuts Ray down: touching Ray after that ends the process."""
        self.thread = threading.Thread(target=self._main, daemon=True)

    def _main(self) -> None:
        try:
            self._attach()
            self.watch()
        except BaseException as exc:  # reported by the benchmark after the run
            self.error = exc

    def watch(self) -> None:
        raise NotImplementedError

    def _attach(self) -> None:
        import ray

        from gyre.services.control.orchestration.factory import actor_name

        deadline, name = time.monotonic() + self.attach_timeout_s, actor_name(self.run_name, "controller")
        while not ray.is_initialized() or name not in {a["name"] for a in ray.util.list_named_actors(True)}:
            if time.monotonic() > deadline or self.stop.is_set():
                raise TimeoutError("the run's controller state actor never appeared")
            time.sleep(0.5)
        self.state = ray.get_actor(name, namespace=self.namespace)

    def wait(self, pred, what: str, timeout_s: float = 240.0) -> dict:
        """The run's status (``gyre status --json``) once ``pred(status)`` holds, polled every 0.5 s.

        Raises:
            TimeoutError: not within ``timeout_s`` seconds, or the run ended first.
        """
        from gyre.services.control.commands import ops

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and not self.stop.is_set():
            st = ops.status(self.state)
            if st and pred(st):
                return st
            time.sleep(0.5)
        raise TimeoutError(f"watcher: {what} not seen within {timeout_s} s (or the run ended)")


@contextmanager
def beside_run(watcher: RunWatcher):
    """Start ``watcher``; make the controller's final ``ray.shutdown`` wait for it (the e2e tests' pattern: a Ray
    call after shutdown would end the process, and none may auto-start a new Ray)."""
    import ray
    from ray._private import auto_init_hook

    real_shutdown, auto = ray.shutdown, auto_init_hook.enable_auto_connect
    auto_init_hook.enable_auto_connect = False

    def shutdown_after_watcher(*args, **kwargs):
        watcher.stop.set()
        watcher.thread.join(timeout=60)
        real_shutdown(*args, **kwargs)

    ray.shutdown = shutdown_after_watcher
    watcher.thread.start()
    try:
        yield watcher
    finally:
        ray.shutdown, auto_init_hook.enable_auto_connect = real_shutdown, auto
