"""The torch.distributed rendezvous of rank processes a test starts: a TCPStore that the test's own process
binds on port 0 (the OS picks the port, and it stays bound) and holds while the ranks run, with every rank a
client of it — torch's ``TORCHELASTIC_USE_AGENT_STORE``, the way torchrun's agent hosts the store for its
workers. Nothing picks a "free" port for rank 0 to bind later, when another process may have taken it."""

from __future__ import annotations

import datetime

import torch.distributed as dist


def rank_store(world_size: int, timeout_s: float = 300.0) -> tuple[dist.TCPStore, dict[str, str]]:
    """``(store, env)``: keep ``store`` referenced until the ranks are done; give each rank ``env`` (with its own
    ``RANK``/``WORLD_SIZE``) so that its ``init_process_group`` (``env://``) joins the store as a client.
    ``timeout_s``: how long the store waits on a key (seconds)."""
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_s))
    return store, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True"}


def run_spawned(target, args_of_rank, world_size: int, timeout_s: float = 600.0) -> None:
    """Run ``target(*args_of_rank(rank))`` in ``world_size`` spawn-context processes (gRPC and torch threads
    never cross a fork) and wait for all of them; asserts each exited 0 within ``timeout_s`` seconds."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=args_of_rank(r)) for r in range(world_size)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout_s)
        assert p.exitcode == 0, f"rank exited {p.exitcode}"
