"""Many rollout identities in one process: fleet simulation at hundreds of rollouts on a few cores.

With ``placement.rollout.rollouts_per_process: M > 1`` (simulated engine only) rollout ``i`` runs in host process
``i // M`` as an identity of its own: its own ``RolloutService`` with its replay connection, prompt leases, weight
subscription, spool and journal, sharing only the process (and its tokenizer). The supervisor cannot tell: it holds a
``HostedRollout`` per identity, whose ``.method.remote(...)`` calls go to that identity through its host
(``RolloutHost.call``), and whose ``kill()`` ends that identity alone as ``ray.kill`` ends a rollout's process. A host
process that dies takes all its identities with it: each is then dead to the supervisor (``RayActorError``) and
restarted, into a new host process (``ServiceFactory``).
"""

from __future__ import annotations

import inspect
import os

import ray
from ray.exceptions import RayActorError

from gyre.services.rollout.service import RolloutService


class HostedRolloutGone(RayActorError):
    """The identity asked for is not in this host (never set up there, or removed): dead, as a killed actor is."""

    def __init__(self, message: str = "") -> None:
        super().__init__()
        self.message = message

    def __str__(self) -> str:
        return self.message


@ray.remote
class RolloutHost:
    """A process holding rollout identities (async actor: every identity's calls run on its one event loop).

    Args:
        run_id: carried by the host's log lines.
        name: the host's service-like name (``rollout-host-{h}``), its log file.
    """

    def __init__(self, run_id: str = "run", name: str = "rollout-host") -> None:
        from gyre.services.common.cpus import pin_from_env
        from gyre.services.common.logs import configure_logging

        configure_logging(run_id, name)
        pin_from_env(name)
        self.rollouts: dict[str, RolloutService] = {}

    async def ping(self) -> int:
        """This host's pid (a liveness check)."""
        return os.getpid()

    async def call(self, rollout_id: str, method: str, *args, **kwargs):
        """``method(*args, **kwargs)`` of identity ``rollout_id`` (awaited when a coroutine). ``setup`` creates it
        first (replacing one of the same id, which is aborted).

        Raises:
            HostedRolloutGone: no identity ``rollout_id`` here (a ``RayActorError``: the supervisor restarts it).
        """
        if method == "setup":
            old = self.rollouts.pop(rollout_id, None)
            if old is not None:
                await old.abort()
            self.rollouts[rollout_id] = RolloutService(hosted=True)
        svc = self.rollouts.get(rollout_id)
        if svc is None or method.startswith("_"):
            raise HostedRolloutGone(f"{rollout_id} is not hosted by process {os.getpid()} (removed, or never set up)")
        result = getattr(svc, method)(*args, **kwargs)
        return await result if inspect.isawaitable(result) else result

    async def remove(self, rollout_id: str) -> bool:
        """End identity ``rollout_id`` now (``RolloutService.abort``); ``False`` if it was not here."""
        svc = self.rollouts.pop(rollout_id, None)
        if svc is None:
            return False
        await svc.abort()
        return True

    async def hosted(self) -> list[str]:
        """The identities this host holds."""
        return sorted(self.rollouts)


class _HostedMethod:
    def __init__(self, host, rollout_id: str, method: str) -> None:
        self.host, self.rollout_id, self.method = host, rollout_id, method

    def remote(self, *args, **kwargs):
        return self.host.call.remote(self.rollout_id, self.method, *args, **kwargs)


class HostedRollout:
    """The supervisor's handle of one hosted identity: ``handle.describe.remote()`` and every other rollout method,
    as on a ``RolloutActor`` handle; ``kill()`` in place of ``ray.kill``.

    Args:
        host: the ``RolloutHost`` actor handle.
        rollout_id: the identity's service name (``rollout-{i}``).
    """

    hosted = True

    def __init__(self, host, rollout_id: str) -> None:
        self.host, self.rollout_id = host, rollout_id

    def __getattr__(self, method: str) -> _HostedMethod:
        if method.startswith("_"):
            raise AttributeError(method)
        return _HostedMethod(self.host, self.rollout_id, method)

    def kill(self) -> None:
        """End this identity (its host removes it; nothing waits for that). A dead host already ended it."""
        try:
            self.host.remove.remote(self.rollout_id)
        except RayActorError:
            pass


def kill_service(handle, ray_module=ray) -> None:
    """End a service: ``handle.kill()`` for a ``HostedRollout``, else ``ray.kill`` of its actor (``ray_module``: the
    caller's ``ray``, which tests replace)."""
    if getattr(handle, "hosted", False) is True:
        handle.kill()
    else:
        ray_module.kill(handle, no_restart=True)
