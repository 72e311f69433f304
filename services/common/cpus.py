"""CPU sets per service: which cores a service's processes may run on, and how many compute threads it starts.

On a node shared by several services (the 2-core default: a vLLM-CPU rollout and a DeepSpeed learner) their
compute threads otherwise land on the same cores: vLLM-CPU binds its OpenMP worker to one core and the learner's
torch threads (one per core) run there too, so both slow down (an OpenMP region waits for its slowest thread).
``placement.<role>.cpus`` gives a role its own cores; the factory passes them to the actor as ``GYRE_CPUS``, with
``OMP_NUM_THREADS`` set to their count, and the actor calls :func:`pin_from_env` first thing:

- every thread of the actor process is bound to the set (``sched_setaffinity``), and so is every process it
  starts afterwards (vLLM's engine core and worker inherit it; vLLM's automatic OpenMP binding,
  ``VLLM_CPU_OMP_THREADS_BIND=auto``, picks its cores from the allowed ones and keeps one for the engine core
  when it has more than one);
- torch's intra-op threads are set to the set's size (``torch.set_num_threads``).

The syntax is Linux's cpuset list (``taskset -c``, ``/sys/fs/cgroup/cpuset.cpus``): ``"0"``, ``"0-3"``,
``"0-3,8,10-11"``; plus an open range ``"N-"``, every CPU of the node (that the process may use) from ``N`` on,
so one recipe fits nodes of any size (the default: rollout ``"0"``, learner ``"1-"``).
"""

from __future__ import annotations

import os
import threading

import structlog

__all__ = ["CPUS_ENV", "CpuSetError", "cpu_env", "format_cpus", "parse_cpus", "pin_from_env"]

CPUS_ENV = "GYRE_CPUS"
"""Environment variable carrying a service's CPU set (cpuset list syntax) from the factory to the actor."""

log = structlog.get_logger("cpus")


class CpuSetError(ValueError):
    """A CPU set that does not parse, or names CPUs this process may not use."""


def _items(spec: str) -> list[tuple[int, int | None]]:
    """``(start, end)`` of each item of ``spec``; ``end`` is ``None`` for an open range ``"N-"``."""
    if not isinstance(spec, str) or not spec.strip():
        raise CpuSetError(f"cpus {spec!r} is empty; expected a cpuset list such as '0', '0-3', '0-3,8' or '1-'")
    items = []
    for item in spec.replace(" ", "").split(","):
        lo, sep, hi = item.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise CpuSetError(f"cpus {spec!r}: {item!r} is not a CPU id or range; expected 'N', 'N-M' or 'N-' "
                              "(non-negative integers; 'N-': every CPU from N on) separated by commas, e.g. '0-3,8'")
        start, end = int(lo), (int(hi) if hi else None) if sep else int(lo)
        if end is not None and end < start:
            raise CpuSetError(f"cpus {spec!r}: range {item!r} ends below its start")
        items.append((start, end))
    return items


def parse_cpus(spec: str, allowed: set[int] | None = None) -> list[int]:
    """CPU ids of a cpuset list such as ``"0-3,8"``, sorted: ``[0, 1, 2, 3, 8]``. An open range ``"N-"`` is
    every CPU of ``allowed`` (this process's, on its node) from ``N`` on; without ``allowed`` it counts as ``N``
    alone (checking a recipe, before the node is known).

    Raises:
        CpuSetError: empty, not ``N`` / ``N-M`` / ``N-`` items separated by commas, a range whose end is below
            its start, a CPU named twice, or an open range with no CPU of ``allowed``; the message quotes ``spec``.
    """
    ids: list[int] = []
    for start, end in _items(spec):
        if end is not None:
            ids.extend(range(start, end + 1))
        elif allowed is None:
            ids.append(start)
        else:
            more = sorted(c for c in allowed if c >= start)
            if not more:
                raise CpuSetError(f"cpus {spec!r}: '{start}-' names no CPU here (this process may use "
                                  f"{format_cpus(sorted(allowed))})")
            ids.extend(more)
    if len(set(ids)) != len(ids):
        raise CpuSetError(f"cpus {spec!r} names a CPU more than once")
    return sorted(ids)


def format_cpus(ids: list[int]) -> str:
    """The shortest cpuset list of ``ids``: ``[0, 1, 2, 3, 8]`` → ``"0-3,8"``."""
    out, ids = [], sorted(set(ids))
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        out.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(out)


def cpu_env(spec: str | None) -> dict[str, str]:
    """Environment of a service given the CPU set ``spec`` (``{}`` for ``None``): ``GYRE_CPUS`` and, when the set
    has no open range (its size is known before the node is), ``OMP_NUM_THREADS`` (its number of CPUs: torch's
    OpenMP thread count; :func:`pin_from_env` sets it in the process otherwise)."""
    if spec is None:
        return {}
    if any(end is None for _, end in _items(spec)):
        return {CPUS_ENV: spec.replace(" ", "")}
    ids = parse_cpus(spec)
    return {CPUS_ENV: format_cpus(ids), "OMP_NUM_THREADS": str(len(ids))}


def pin_from_env(service: str) -> list[int] | None:
    """Bind this process to ``$GYRE_CPUS`` (all its threads, and every process it starts later) and set torch's
    intra-op threads to their count; returns the CPU ids, or ``None`` when the variable is unset.

    Raises:
        CpuSetError: the set does not parse, or names CPUs outside this process's allowed ones (another node's,
            or outside the container's cgroup); the message names ``service``, the set and the allowed CPUs.
    """
    spec = os.environ.get(CPUS_ENV)
    if not spec:
        return None
    if not hasattr(os, "sched_setaffinity"):
        raise CpuSetError(f"placement cpus {spec!r} for {service}: CPU sets need Linux (sched_setaffinity); "
                          "leave placement.<role>.cpus unset on this platform")
    allowed = os.sched_getaffinity(0)
    try:
        ids = parse_cpus(spec, allowed)
    except CpuSetError as exc:
        raise CpuSetError(f"placement cpus for {service}: {exc}") from None
    outside = sorted(set(ids) - allowed)
    if outside:
        raise CpuSetError(f"placement cpus {spec!r} for {service}: CPU(s) {format_cpus(outside)} are not available "
                          f"on this node (this process may use {format_cpus(sorted(allowed))}); set "
                          "placement.<role>.cpus to CPUs of the node the role is placed on")
    for tid in _thread_ids():
        try:
            os.sched_setaffinity(tid, ids)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass
    os.sched_setaffinity(0, ids)  # this thread, whatever /proc listed
    os.environ["OMP_NUM_THREADS"] = str(len(ids))  # for OpenMP runtimes loaded from here on
    import torch

    torch.set_num_threads(len(ids))
    log.info("cpus_pinned", service=service, cpus=format_cpus(ids), torch_threads=len(ids),
             thread=threading.get_native_id())
    return ids


def _thread_ids() -> list[int]:
    """Native ids of this process's threads (``/proc/self/task``; only this thread where it is absent)."""
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return [threading.get_native_id()]
