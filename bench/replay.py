"""Replay benchmark: ``python -m bench.replay [--quick] [--dir DIR]``. The last line printed is one JSON object.

Every ratio's baseline is measured in the same run, on the same machine and disk:

- ``ingest_ratio``: durable inserts (WAL + fsync before each ack) in MB/s of Arrow IPC payload ÷ a raw
  grpcio byte stream with the same message (``InsertRequest`` of 256 trajectories), method shape,
  server options, process memory setup (``replay.memory.tune_malloc``) and client (2 pipelined bidi
  streams, servers in their own processes).
  ``ingest_ratio_nofsync``: the same with ``durability="write"``. ``server_cpu_ms_per_message``: the
  server process's CPU (user + system) per message for each (medians; steadier than MB/s on a shared box).
  The ceilings on this machine, same run (``bench.replay_baselines``), each ÷ raw: ``keep_ratio`` (a
  server that only keeps each payload), ``append_floor_ratio`` (keeps it and appends it to a file:
  the ceiling of ``ingest_ratio_nofsync``) and ``durable_floor_ratio`` (keeps, appends and fsyncs
  before the answer, group-committed: the ceiling of ``ingest_ratio``).
- ``sample_p99_ms``: Sample RPCs of 32 groups × 8 = 256 trajectories (lease durable before the answer,
  then released) at two buffer sizes, 10k/100k trajectories with ``--quick``, 100k/1M without.
- ``snapshot_ratio``: snapshot MB/s (bytes of the snapshot's files ÷ the server's capture-to-commit time,
  otherwise idle) ÷ writing the same number of bytes sequentially to the same directory with one fsync
  (alternated, medians).
  ``insert_p99_during_snapshot_ratio``: insert RPC p99 while snapshots run ÷ p99 with none running
  (3 alternated rounds, pooled: snapshots until >= 40 inserts ran during them, then as many inserts
  idle, at most 1000).
- ``restore_s_per_gb``: the restarted server's restore time (newest snapshot + WAL tail after a
  ``kill -9``) per GB of stored Arrow data.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import NamedTuple

import numpy as np

from bench.replay_baselines import KINDS, RAW_METHOD, serve
from bench.replay_parts import (GROUP_SIZE, Server, fsync_ms, p99_ms, requests, sequential_write_mb_s,
                                snapshot_bytes, stream, trajectory_batch)
from gyre.services.common.replay_client import ReplayClient

GROUPS = 32
"""Groups per insert message and per sampled batch (× 8 = 256 trajectories)."""


def replay_config(durability: str) -> dict:
    return {"capacity_groups": 10_000_000, "max_staleness": 1_000_000, "max_batch_bytes": 256 << 20,
            "wal": {"durability": durability}, "snapshot": {"interval_s": None, "wal_bytes": None}}


def ingest_mb_s(kind: str, root: Path, batches: int, seed: int) -> tuple[float, float]:
    """MB/s of payload streamed to a fresh ``kind`` server (a baseline of ``bench.replay_baselines``,
    or replay with WAL durability ``kind``) and the server process's CPU milliseconds (user + system)
    per message meanwhile."""
    reqs = list(requests(seed * 10_000_000, batches, GROUPS, seed))
    directory = root / f"ingest-{kind}-{seed}"
    baseline = kind in KINDS
    server = Server(kind if baseline else "replay", directory, None if baseline else replay_config(kind))
    halves = [reqs[0::2], reqs[1::2]]
    sent = [0, 0]
    method = RAW_METHOD if baseline else "/gyre.replay.v1.ReplayService/Insert"

    def run(i: int) -> None:
        sent[i] = stream(server.address, iter(halves[i]), method)

    cpu0 = server.cpu_seconds()
    t0 = time.perf_counter()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    cpu_ms = (server.cpu_seconds() - cpu0) * 1000.0 / batches
    server.stop()
    shutil.rmtree(directory, ignore_errors=True)
    return sum(sent) / 1e6 / seconds, cpu_ms


def sample_latencies(client: ReplayClient, n: int) -> list[float]:
    out = []
    for i in range(n + 10):
        t0 = time.perf_counter()
        lease, _ = client.sample(GROUPS, learner_version=0, timeout_s=5.0)
        if i >= 10:
            out.append(time.perf_counter() - t0)
        client.release([lease])
    return out


def insert_latencies(client: ReplayClient, first_prompt: int, n: int, while_alive=None) -> list[float]:
    """Seconds per Insert RPC of one 256-trajectory batch, one at a time (stops when ``while_alive`` ends)."""
    out, rng = [], np.random.default_rng(first_prompt)
    for b in range(n):
        table = trajectory_batch(first_prompt + b * GROUPS, GROUPS, rng)
        if while_alive is not None and not while_alive.is_alive():
            break
        t0 = time.perf_counter()
        client.insert(table)
        out.append(time.perf_counter() - t0)
    return out


def snapshots_under_load(client: ReplayClient, next_prompt: int, min_inserts: int = 40,
                         max_snapshots: int = 4) -> tuple[list[float], list[float], int]:
    """Snapshot RPC times and insert latencies while they run (snapshots one after another until
    ``min_inserts`` inserts ran during them); returns (snap_s, insert_s, next_prompt)."""
    snaps, during = [], []
    def snapshot() -> None:
        t0 = time.perf_counter()
        client.snapshot()
        snaps.append(time.perf_counter() - t0)

    while len(during) < min_inserts and len(snaps) < max_snapshots:
        t = threading.Thread(target=snapshot)
        t.start()
        time.sleep(0.005)
        got = insert_latencies(client, next_prompt, 10_000, while_alive=t)
        next_prompt += (len(got) + 1) * GROUPS
        during += got
        t.join()
    return snaps, during, next_prompt


def insert_p99_rounds(client: ReplayClient, next_prompt: int, rounds: int = 3, per_round: int = 40,
                      max_idle: int = 1000) -> tuple[list[float], list[float], int]:
    """Insert latencies while snapshots run and with none running, in alternated rounds (so a change of
    load on the machine hits both alike). Each idle round has as many inserts as the snapshot round
    before it, up to ``max_idle`` (0.5 GB): a p99 of a few dozen inserts is just their largest one or
    two. Returns (idle_s, during_s, next_prompt)."""
    idle, during = [], []
    for _ in range(rounds):
        insert_latencies(client, next_prompt, 1)  # something new, so the snapshot has work to do
        _, got, next_prompt = snapshots_under_load(client, next_prompt + GROUPS, per_round)
        during += got
        n = min(max(len(got), per_round), max_idle)
        idle += insert_latencies(client, next_prompt, n)
        next_prompt += n * GROUPS
    return idle, during, next_prompt


def ingest_phase(root: Path, batches: int, rounds: int) -> dict:
    speeds: dict[str, list[float]] = {k: [] for k in (*KINDS, "fsync", "write")}
    cpu: dict[str, list[float]] = {k: [] for k in speeds}
    for r in range(rounds):  # interleaved, so load changes hit all alike
        for kind in speeds:
            mb_s, cpu_ms = ingest_mb_s(kind, root, batches, seed=r + 1)
            speeds[kind].append(mb_s)
            cpu[kind].append(cpu_ms)
    raw, keep, append, durable, fsync, nofsync = (statistics.median(speeds[k]) for k in speeds)
    print(f"ingest MB/s: raw {raw:.0f}, fsync {fsync:.0f}, no fsync {nofsync:.0f}; ceilings: keep {keep:.0f}, "
          f"keep + append {append:.0f}, keep + append + fsync {durable:.0f}", flush=True)
    return dict(raw_stream_mb_s=round(raw, 1), ingest_mb_s=round(fsync, 1), ingest_nofsync_mb_s=round(nofsync, 1),
                ingest_ratio=round(fsync / raw, 3), ingest_ratio_nofsync=round(nofsync / raw, 3),
                keep_mb_s=round(keep, 1), append_floor_mb_s=round(append, 1), durable_floor_mb_s=round(durable, 1),
                keep_ratio=round(keep / raw, 3), append_floor_ratio=round(append / raw, 3),
                durable_floor_ratio=round(durable / raw, 3), ingest_of_durable_floor=round(fsync / durable, 3),
                ingest_nofsync_of_append_floor=round(nofsync / append, 3),
                server_cpu_ms_per_message={k: round(statistics.median(v), 2) for k, v in cpu.items()})


def sample_phase(server: Server, client: ReplayClient, sizes: tuple[int, int]) -> tuple[dict, int]:
    """Fill to each size and time samples there; returns the results and the trajectories stored."""
    by_size, stored = {}, 0
    for size in sizes:
        need = -(-(size - stored) // (GROUPS * GROUP_SIZE))
        stream(server.address, requests(stored // GROUP_SIZE, need, GROUPS, seed=size))
        stored += need * GROUPS * GROUP_SIZE
        by_size[str(size)] = round(p99_ms(sample_latencies(client, 200)), 2)
        print(f"sample p99 at {client.info().stored_trajectories} trajectories: {by_size[str(size)]} ms", flush=True)
    return dict(sample_p99_ms=by_size[str(sizes[-1])], sample_p99_ms_by_size=by_size,
                sample_p99_growth=round(by_size[str(sizes[-1])] / by_size[str(sizes[0])], 2)), stored


class SnapshotRound(NamedTuple):
    """One idle snapshot of ``snapshot_rounds`` and its baseline."""

    nbytes: int
    """Bytes of the snapshot's files on disk (Arrow files, state and manifest)."""
    seconds: float
    """The server's capture → commit time (``Info.last_snapshot_seconds``)."""
    sequential_mb_s: float
    """MB/s of writing ``nbytes`` sequentially to the same directory with one fsync, right after."""


def snapshot_rounds(server: Server, client: ReplayClient, root: Path, next_prompt: int,
                    rounds: int = 3) -> tuple[list[SnapshotRound], int]:
    """Idle snapshots alternating with the sequential-write baseline, each after one new insert (so the
    snapshot has work to do); returns the rounds and the next unused prompt index. The server must run
    on this machine (the snapshot's files are measured where it says it wrote them)."""
    out = []
    for r in range(rounds):
        stream(server.address, requests(next_prompt, 1, GROUPS, seed=50 + r))  # something new to snapshot
        next_prompt += GROUPS
        path = client.snapshot()
        if not path:
            raise RuntimeError("replay wrote no snapshot after a new insert")
        nbytes = snapshot_bytes(Path(path))
        seconds = client.info().last_snapshot_seconds
        out.append(SnapshotRound(nbytes, seconds, sequential_write_mb_s(root, nbytes)))
    return out, next_prompt


def snapshot_rates(rounds: list[SnapshotRound]) -> dict:
    """Medians over ``rounds``: bytes (GB), seconds, snapshot MB/s (each round's bytes ÷ its seconds),
    baseline MB/s, and their ratio ``snapshot_ratio``."""
    snap_mb_s = statistics.median(r.nbytes / 1e6 / r.seconds for r in rounds)
    seq_mb_s = statistics.median(r.sequential_mb_s for r in rounds)
    return dict(snapshot_gb=round(statistics.median(r.nbytes for r in rounds) / 1e9, 3),
                snapshot_s=round(statistics.median(r.seconds for r in rounds), 3), snapshot_mb_s=round(snap_mb_s, 1),
                sequential_write_mb_s=round(seq_mb_s, 1), snapshot_ratio=round(snap_mb_s / seq_mb_s, 3))


def snapshot_phase(server: Server, client: ReplayClient, root: Path, next_prompt: int) -> tuple[dict, int]:
    stored_bytes = client.info().stored_bytes
    rounds, next_prompt = snapshot_rounds(server, client, root, next_prompt)
    rates = snapshot_rates(rounds)
    idle, during, next_prompt = insert_p99_rounds(client, next_prompt)
    out = dict(stored_gb=round(stored_bytes / 1e9, 3), **rates, insert_p99_idle_ms=round(p99_ms(idle), 2),
               insert_p99_during_snapshot_ms=round(p99_ms(during), 2),
               insert_p99_during_snapshot_ratio=round(p99_ms(during) / p99_ms(idle), 3),
               inserts_idle=len(idle), inserts_during_snapshots=len(during))
    print(f"snapshot {rates['snapshot_mb_s']:.0f} MB/s vs sequential write {rates['sequential_write_mb_s']:.0f} MB/s; "
          f"insert p99 idle {out['insert_p99_idle_ms']} ms, during snapshots {out['insert_p99_during_snapshot_ms']} ms",
          flush=True)
    return out, next_prompt


def restore_phase(server: Server, client: ReplayClient, directory: Path, next_prompt: int) -> dict:
    stream(server.address, requests(next_prompt, 20, GROUPS, seed=99))  # a WAL tail after the snapshot
    client.close()
    server.stop(signal.SIGKILL)
    t0 = time.perf_counter()
    server = Server("replay", directory, replay_config("fsync"))
    serving = time.perf_counter() - t0
    info = ReplayClient(server.address).info()
    server.stop()
    return dict(restore_s=round(info.restore_seconds, 3), restart_to_serving_s=round(serving, 3),
                restore_s_per_gb=round(info.restore_seconds / (info.stored_bytes / 1e9), 3),
                restore_records_replayed=info.restore_records_replayed)


GOALS = {"ingest_ratio": (">=", 0.6), "ingest_ratio_nofsync": (">=", 0.85), "sample_p99_ms": ("<", 20.0),
         "snapshot_ratio": (">=", 0.5), "insert_p99_during_snapshot_ratio": ("<=", 2.0),
         "restore_s_per_gb": ("<=", 5.0)}
"""The issue's goal for each headline number."""


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.replay", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="100k trajectories instead of 1M; fewer messages")
    parser.add_argument("--dir", help="where the WAL/snapshots go (default: a temp dir)")
    parser.add_argument("--baseline", choices=KINDS, help=argparse.SUPPRESS)
    parser.add_argument("--baseline-port-file", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.baseline is not None:  # a baseline server process of ingest_mb_s
        serve(args.baseline, args.baseline_port_file, Path(args.dir) if args.dir else None)
        return {}
    sizes = (10_000, 100_000) if args.quick else (100_000, 1_000_000)
    root = Path(args.dir or tempfile.mkdtemp(prefix="gyre-bench-replay-")).resolve()  # the servers' cwd is REPO
    root.mkdir(parents=True, exist_ok=True)
    out: dict = {"bench": "replay", "quick": args.quick, "trajectories_per_message": GROUPS * GROUP_SIZE}
    out["disk_fsync_p50_ms"], out["disk_fsync_p99_ms"] = (round(x, 2) for x in fsync_ms(root))
    out.update(ingest_phase(root, 120 if args.quick else 600, rounds=3))
    server = Server("replay", root / "main", replay_config("fsync"))
    client = ReplayClient(server.address, timeout_s=600)
    sampled, stored = sample_phase(server, client, sizes)
    snapped, next_prompt = snapshot_phase(server, client, root, stored // GROUP_SIZE)
    out.update(**sampled, **snapped, **restore_phase(server, client, root / "main", next_prompt))
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    out["goals_met"] = {k: (out[k] >= v if op == ">=" else out[k] < v if op == "<" else out[k] <= v)
                        for k, (op, v) in GOALS.items()}
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
