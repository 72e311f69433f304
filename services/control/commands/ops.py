"""Operating a running run: the ``ControllerState`` actor the supervisor reads every tick, and the small
Ray client calls behind ``gyre status / scale / restart / checkpoint``.

The controller creates one detached actor ``gyre:{run}:controller`` per run in the recipe's namespace.
CLI commands connect to the run's Ray cluster (``--address``, else the address the controller recorded in
``{run_dir}/{run}/ray_connection.json``, else in ``ray_address`` (runs from before the record), else
``auto``), find that actor and leave a request in it; the supervisor applies it on its next tick (about a
second) and publishes the status the CLI reads back.

Ray 2.60 turns token auth on for every private ``ray.init()`` head unless ``RAY_AUTH_MODE`` is set, but a
driver joining an explicit address uses token auth only if told to. So the controller also records its
auth mode and token file (never the token), and the ops commands join with the same settings
(``services.control.commands.ray_connection``).
"""

from __future__ import annotations

import time
from pathlib import Path

import ray

from gyre.services.common.names import ServiceName
from gyre.services.control.orchestration.factory import actor_name
from gyre.services.control.commands.ray_connection import OpsError, RayConnection, connection_for, join

__all__ = ["OpsError", "RayConnection", "connect", "create_state", "resolve_run", "status", "scale", "restart",
           "checkpoint", "format_status", "reward_swap"]


class FleetRequests:
    """Desired fleet shape, pending operator requests and the last published status of one run
    (the body of the ``ControllerState`` actor; plain Python so it is testable without Ray)."""

    def __init__(self, run: str, namespace: str, rollouts: int) -> None:
        self.run, self.namespace = run, namespace
        self.desired_rollouts = rollouts
        self.restart_requests: list[str] = []
        self.checkpoint_requested = False
        self.reward_swaps: list[dict] = []
        """Pending ``{"id": n, "swap": {task: [reward dicts]}}`` (``services.control.commands.reward_swaps``), oldest first."""
        self.swap_results: dict[int, dict] = {}
        """Swap id → what ``reward_swaps.apply_swap`` answered."""
        self._swap_ids = 0
        self._status: dict = {}

    def request_scale(self, role: str, count: int) -> int:
        """Desired number of ``role`` services (only ``rollout`` scales); returns the previous count.

        Raises:
            ValueError: another role, or ``count < 1``.
        """
        if role != "rollout":
            raise ValueError(f"cannot scale {role!r}: only 'rollout' scales (replay and learner are single)")
        if not isinstance(count, int) or count < 1:
            raise ValueError(f"rollout count must be an integer >= 1, got {count!r}")
        previous, self.desired_rollouts = self.desired_rollouts, count
        return previous

    def request_restart(self, service: str) -> None:
        """Restart ``service`` (a name from the status, e.g. ``learner`` or ``rollout-1``) on the next tick.

        Raises:
            ValueError: no such service in the last published status.
        """
        names = [s["name"] for s in self._status.get("services", [])]
        if names and service not in names:
            raise ValueError(f"no service {service!r} in run {self.run}; services: {', '.join(names)}")
        self.restart_requests.append(service)

    def request_checkpoint(self) -> None:
        self.checkpoint_requested = True

    def request_reward_swap(self, swap: dict) -> int:
        """Queue a reward swap (already validated and canonical: ``reward_swaps.canonical_swap``); returns its id,
        whose result ``reward_swap_result`` answers once the supervisor applied or refused it.

        Raises:
            ValueError: ``swap`` is not a non-empty ``{task: [reward dicts]}``.
        """
        if not swap or not isinstance(swap, dict) or not all(isinstance(v, list) and v for v in swap.values()):
            raise ValueError(f"reward swap {swap!r}: expected {{task: [reward, ...]}} (reward_swaps.canonical_swap)")
        self._swap_ids += 1
        self.reward_swaps.append({"id": self._swap_ids, "swap": swap})
        return self._swap_ids

    def finish_reward_swap(self, swap_id: int, result: dict) -> None:
        self.swap_results[swap_id] = result

    def reward_swap_result(self, swap_id: int) -> dict | None:
        """What the supervisor answered for swap ``swap_id`` (``None``: not applied yet)."""
        return self.swap_results.get(swap_id)

    def take_requests(self) -> dict:
        """For the supervisor: ``{"rollouts": desired count, "restart": [names], "checkpoint": bool,
        "reward_swaps": [{"id", "swap"}]}``; restart, checkpoint and swap requests are cleared once taken."""
        out = {"rollouts": self.desired_rollouts, "restart": self.restart_requests,
               "checkpoint": self.checkpoint_requested, "reward_swaps": self.reward_swaps}
        self.restart_requests, self.checkpoint_requested, self.reward_swaps = [], False, []
        return out

    def publish(self, status: dict) -> None:
        self._status = {**status, "run": self.run, "namespace": self.namespace,
                        "desired_rollouts": self.desired_rollouts}

    def status(self) -> dict:
        return self._status


ControllerState = ray.remote(FleetRequests)
"""The run's detached ``gyre:{run}:controller`` actor."""


def create_state(run: str, namespace: str, rollouts: int):
    """The run's detached ``ControllerState`` (re-used when a previous driver of this run left one)."""
    return ControllerState.options(name=actor_name(run, "controller"), namespace=namespace, lifetime="detached",
                                   get_if_exists=True, num_cpus=0).remote(run, namespace, rollouts)


def running_runs(namespace: str) -> list[str]:
    """Names of the runs with a live ``ControllerState`` in ``namespace`` (needs ``ray.init`` first)."""
    return sorted(a["name"].split(":")[1] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["namespace"] == namespace and a["name"].startswith("gyre:")
                  and a["name"].endswith(":controller"))


def resolve_run(run: str | None, namespace: str, run_dir: str | Path = "runs",
                address: str | None = None) -> tuple[str, RayConnection]:
    """``(run name, how to join its cluster)``; without ``run``, the only run running in ``namespace`` at
    ``address`` (default ``auto``).

    Raises:
        OpsError: a bad connection record; no run given and none, or more than one, is running.
    """
    if run is not None:
        return run, connection_for(run, run_dir, address)
    conn = RayConnection(address or "auto")
    join(conn, namespace, "(any)")
    runs = running_runs(namespace)
    if len(runs) != 1:
        raise OpsError(f"--run is needed: {len(runs)} gyre runs are running in namespace {namespace}"
                       f"{': ' + ', '.join(runs) if runs else ''}")
    return runs[0], conn


def connect(run: str, namespace: str, conn: RayConnection):
    """Join ``conn``'s cluster (its recorded auth settings applied) and return the run's
    ``ControllerState`` handle.

    Raises:
        OpsError: see ``ray_connection.join``; or no running run named ``run`` in ``namespace``.
    """
    join(conn, namespace, run)
    try:
        return ray.get_actor(actor_name(run, "controller"), namespace=namespace)
    except ValueError:
        others = running_runs(namespace)
        raise OpsError(f"no running gyre run named {run} in namespace {namespace} "
                       f"({'running: ' + ', '.join(others) if others else 'none is running there'})") from None


def _call(state, method: str, *args):
    try:
        return ray.get(getattr(state, method).remote(*args), timeout=30)
    except ray.exceptions.RayTaskError as exc:
        cause = exc.as_instanceof_cause()
        raise OpsError(str(cause.cause if hasattr(cause, "cause") else cause)) from None


def status(state) -> dict:
    """The status the supervisor published last (see ``Supervisor.status``)."""
    return _call(state, "status")


def scale(state, role: str, count: int) -> int:
    """Ask for ``count`` services of ``role``; returns the previous desired count."""
    return _call(state, "request_scale", role, count)


def restart(state, service: str) -> None:
    _call(state, "request_restart", service)


def checkpoint(state) -> None:
    _call(state, "request_checkpoint")


def reward_swap(state, swap: dict, timeout_s: float = 300.0, poll_s: float = 0.5) -> dict:
    """Queue ``swap`` (canonical, checked) and wait until the supervisor applied or refused it; returns its result
    (``reward_swaps.apply_swap``).

    Raises:
        OpsError: the state actor refused the request, or no result came within ``timeout_s`` seconds (the
            request stays queued: the supervisor applies it when it next ticks).
    """
    swap_id = _call(state, "request_reward_swap", swap)
    deadline = time.monotonic() + timeout_s
    while (result := _call(state, "reward_swap_result", swap_id)) is None:
        if time.monotonic() > deadline:
            raise OpsError(f"reward swap {swap_id}: no answer from the run's supervisor within {timeout_s:.0f} s "
                           "(it is queued and applied on the supervisor's next tick; see gyre status)")
        time.sleep(poll_s)
    return result


def _reward_lines(st: dict) -> list[str]:
    """``gyre status``'s reward lines: each distinct ``{task: reward_fn_version}`` and the rollouts using it."""
    groups: dict[str, list[str]] = {}
    for s in st["services"]:
        if s.get("reward_versions"):
            text = ", ".join(f"{task}={v}" for task, v in sorted(s["reward_versions"].items()))
            groups.setdefault(text, []).append(s["name"])
    swaps = st.get("reward_swaps", 0)
    lines = [f"rewards    {text} on {', '.join(sorted(names, key=ServiceName.parse))}"
             for text, names in groups.items()]
    models = (st.get("reward_models") or {}).get("models") or {}
    lines += [f"rm         {version} loaded by reward_model" for version in models.values()]
    return lines + ([f"swaps      {swaps} reward swap(s) journaled (reward_swaps.jsonl)"] if swaps else [])


def format_status(st: dict) -> str:
    """``gyre status`` text: one line per service, then the run's gauges."""
    if not st:
        return "status not published yet (the controller is still starting services)"
    fmt = lambda v, spec="": "-" if v is None else format(v, spec)  # noqa: E731
    lines = [f"run {st['run']} (namespace {st['namespace']}), status {time.time() - st['updated_at']:.0f} s old",
             f"{'service':<12}{'pid':>8}  {'node':<16}{'version':>8}{'restarts':>10}  {'metrics':>8}  address"]
    for s in st["services"]:
        lines.append(f"{s['name']:<12}{fmt(s['pid']):>8}  {fmt(s['node']):<16}{fmt(s['version']):>8}"
                     f"{s['restarts']:>10}  {fmt(s.get('metrics_port')):>8}  {s['address'] or '-'}")
    ranks = st.get("learner_ranks", 1)
    lines += [f"policy     learner v{fmt(st['learner_version'])}{f' ({ranks} ranks)' if ranks > 1 else ''}, "
              f"rollouts {st['rollout_versions']}, "
              f"lag {fmt(st['lag'])} versions",
              f"throughput generate {st['rollout_tokens_per_s']:.0f} tok/s, learn "
              f"{fmt(st['learner_tokens_per_s'], '.0f')} tok/s",
              f"replay     {fmt(st['replay_groups'])} groups ready",
              f"checkpoint {st['last_checkpoint'] or 'none yet'} ({fmt(st['checkpoint_age_s'], '.0f')} s old)",
              f"rollouts   {len([s for s in st['services'] if s['role'] == 'rollout'])} running, "
              f"{st['desired_rollouts']} desired"]
    lines += _reward_lines(st)
    if st.get("logs"):  # absent in a status published by an older controller
        lines.append(f"logs       {st['logs']}/<service>.log")
    return "\n".join(lines)
