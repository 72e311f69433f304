"""Issue 5 (c): stop replay for a while — no trajectory lost or duplicated after it returns.

A rollout worker with a spool, in a process of its own (``tests.fault.rollout_proc``), against a real replay
server process. Outage 1: SIGKILL replay while groups are in flight; the worker finishes them into its spool;
restart replay on the same directory and port (the port the OS picked for the first start); the same worker
reconnects, delivers its spool and keeps generating. Outage 2: SIGKILL replay again with groups in flight; once
the worker has finished them into its spool and its flusher is retrying them, SIGKILL the worker's process too (no
``finally``, no shutdown path: what it counted as delivered must already be on disk); restart replay; a new worker
process on the same spool recovers it, delivers what the first one left, generates 6 more groups, stops cleanly
and drains (in the real-vLLM test the successor runs on the fake engine: recovering a spool needs no engine).
Every generated group must be stored in replay exactly once, nothing else may be, and the spool must end empty.

``test_replay_outage_with_real_vllm_loses_and_duplicates_nothing`` is the issue's test: the worker generates
with the real vLLM engine (``rollout.engine.RolloutEngine`` on CPU, the tiny random Llama of
``tests/tiny_model.py`` and its real tokenizer), the real ``ReplayClient`` and the real spool; replay is
``python -m gyre.services.replay.main`` with an fsync'd WAL, so whatever it acknowledged before the kill is
restored. Groups are long enough (``ignore_eos``, ``MAX_NEW_TOKENS``) that some are in flight when replay dies;
the outage lasts until those have finished into the spool and the flusher has failed to deliver at least once
(no fixed sleeps). ``test_replay_outage_with_fake_engine_...`` runs the same scenario on
``tests.fakes.SlowEngine`` (no vLLM start; ~20 s on two cores, most of it the worker processes' imports).

Without the spool (or with a spool that keeps a group anywhere but in a committed file once it is counted as
done — in memory until shutdown, or under its temp name) the groups the killed worker had spooled would be
missing (they are delivered only by the second worker's recovery); without dedup, re-sent groups would appear
twice.
"""

from __future__ import annotations

import math
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import yaml

from gyre.services.common import grpc_common, port_file
from gyre.services.replay import server as replay_server
from gyre.services.common.replay_client import ReplayClient
from tests.fault.replay_proc import REPO
from tests.fault.rollout_proc import GROUP_SIZE, MAX_NEW_TOKENS, Events, WorkerProcess

REPLAY = {"wal": {"durability": "fsync"}, "snapshot": {"interval_s": None, "wal_bytes": None},
          "max_staleness": 1_000_000, "capacity_groups": 1_000_000}
START_S = 180.0
"""Deadline for a worker process to reach its first milestone (a vLLM start on two loaded cores included)."""


def start_replay(tmp_path: Path, port: int, log, procs: list) -> tuple[subprocess.Popen, int]:
    """Replay on ``port`` (0: one the OS picks and keeps, read back from its port file; a restart passes the port
    the first start got: the worker's address stays); returns the process and its port once it serves."""
    cfg, bound = tmp_path / "replay.yaml", tmp_path / "replay.port"
    cfg.write_text(yaml.safe_dump(REPLAY))
    bound.unlink(missing_ok=True)
    procs.append(subprocess.Popen([sys.executable, "-m", "gyre.services.replay.main", "--config", str(cfg),
                                   "--dir", str(tmp_path / "replay"), "--port", str(port), "--port-file", str(bound)],
                                  cwd=REPO, stdout=log, stderr=subprocess.STDOUT))
    port = port_file.wait(bound, procs[-1], 60.0)
    address = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 60.0
    while not grpc_common.check_health(address, replay_server.SERVICE_NAME, timeout_s=0.5):
        assert procs[-1].poll() is None, f"replay exited with {procs[-1].returncode}"
        assert time.monotonic() < deadline, f"replay at {address} not serving after 60 s"
        time.sleep(0.05)
    return procs[-1], port


def spooled(spool: Path) -> int:
    """Groups committed to the spool and not yet acknowledged (entry files, not the temp files of puts)."""
    return len([p for p in spool.glob("*.arrow") if not p.name.startswith(".")])


def kill_replay_while_generating(replay: subprocess.Popen, worker: WorkerProcess, spool: Path) -> dict:
    """SIGKILL replay while ``worker`` generates at least 2 groups; return (replay still down) once nothing is
    generating any more, the worker counted every group it generated as delivered and its flusher has failed to
    deliver at least once."""
    before = worker.wait_for(lambda ev: len(ev.in_flight) >= 2, "2 groups in flight", START_S)
    replay.send_signal(signal.SIGKILL)
    replay.wait()
    retries = worker.events().retries

    def settled(ev: Events) -> bool:  # no prompt can be leased while replay is down: this state is stable
        return not ev.in_flight and set(ev.done) == ev.generated_groups and ev.retries > retries
    worker.wait_for(settled, "groups in flight at the kill generated and delivered to the spool, an insert retried")
    return {"in_flight_at_kill": len(before.in_flight), "spooled": spooled(spool)}


def outage_scenario(tmp_path: Path, engine: str, model: str | None, log, procs: list,
                    recover_engine: str | None = None) -> dict:
    """Two outages (see the module docstring); returns what happened (``address``: replay's), for
    ``check_exactly_once``. The recovering worker runs on ``recover_engine`` (default: ``engine``)."""
    replay, port = start_replay(tmp_path, 0, log, procs)
    address, spool = f"127.0.0.1:{port}", tmp_path / "spool"
    first = WorkerProcess(tmp_path, "first", address, engine, model)
    procs.append(first)
    first.wait_for(lambda ev: len(ev.acked) >= 6, "6 groups delivered", START_S)
    out = {"first": kill_replay_while_generating(replay, first, spool)}
    (replay, _), generated = start_replay(tmp_path, port, log, procs), len(first.events().generated)
    first.wait_for(lambda ev: len(ev.acked) >= generated and len(ev.generated) >= generated + 3,
                   "the live worker delivered its spool after replay returned and kept generating")
    out["second"] = kill_replay_while_generating(replay, first, spool)
    out.update(first_exit=first.kill(), first_events=first.events(), left_by_first=spooled(spool))
    start_replay(tmp_path, port, log, procs)
    recover_engine = recover_engine or engine
    second = WorkerProcess(tmp_path, "second", address, recover_engine, model if recover_engine == engine else None,
                           stop_after=6)
    procs.append(second)
    out.update(second_exit=second.wait(START_S), second_events=second.events(), address=address)
    return out


def trajectory_ids(group_ids: set[str]) -> set[str]:
    """The ``GROUP_SIZE`` trajectory ids of each group id ``"{prompt_index}-{attempt}"``."""
    out = set()
    for gid in group_ids:
        prompt_index, attempt = gid.split("-")
        out.update(f"{prompt_index}-{i}-{attempt}" for i in range(GROUP_SIZE))
    return out


def check_exactly_once(out: dict, client: ReplayClient, spool: Path):
    """Assert the outage's invariants; return the table of every stored trajectory."""
    ev1, ev2 = out["first_events"], out["second_events"]
    assert out["first_exit"] == -signal.SIGKILL, out  # the first worker died of the kill, not before it
    assert out["second_exit"] == 0, out
    # Every generated group was counted as delivered (the first worker was killed with none in flight) ...
    assert set(ev1.done) == ev1.generated_groups and set(ev2.done) == ev2.generated_groups, out
    # ... and every one of them is stored, exactly once, and nothing else.
    generated = trajectory_ids(ev1.generated_groups | ev2.generated_groups)
    info = client.info()
    _, table = client.sample(info.size_groups, learner_version=0, timeout_s=5.0, consumer="checker")
    stored = Counter(table.column("trajectory_id").to_pylist())
    assert max(stored.values()) == 1, sorted(t for t, n in stored.items() if n > 1)
    assert stored.keys() == generated, {"lost": sorted(generated - stored.keys()),
                                        "never_generated": sorted(stored.keys() - generated)}
    assert info.stored_trajectories == len(generated)
    # Both outages left groups in the spool while replay was down; the killed worker left some to its
    # successor, after failing to deliver them; the successor delivered them and drained its spool.
    assert out["left_by_first"] >= out["second"]["spooled"] >= 1 and out["first"]["spooled"] >= 1, out
    assert ev1.retries >= 2 and len(ev2.acked) >= out["left_by_first"] and ev2.left == 0, out
    assert spooled(spool) == 0 and list(spool.glob(".tmp-*")) == []
    assert not (spool / "quarantine").exists()
    return table


def run_outage(tmp_path: Path, engine: str, model: str | None = None, recover_engine: str | None = None):
    """The whole outage scenario with worker processes on ``engine`` (the recovering one on ``recover_engine``);
    returns the stored trajectories and what happened."""
    log, procs, client = open(tmp_path / "replay.log", "ab"), [], None
    try:
        out = outage_scenario(tmp_path, engine, model, log, procs, recover_engine)
        print({k: v for k, v in out.items() if not k.endswith("_events")})
        client = ReplayClient(out["address"], timeout_s=10.0)
        return check_exactly_once(out, client, tmp_path / "spool"), out
    finally:
        if client is not None:
            client.close()
        for proc in procs:
            if isinstance(proc, WorkerProcess):
                proc.kill()
            else:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGKILL)
                proc.wait()
        log.close()


def test_replay_outage_with_real_vllm_loses_and_duplicates_nothing(tmp_path, tiny_llama):
    # The worker that lives through both outages and is SIGKILLed generates with vLLM; its successor only has to
    # recover the spool and deliver it (what this test is about), so it runs on the fake engine: one vLLM start
    # fewer (~45 s on two cores).
    table, out = run_outage(tmp_path, "vllm", str(tiny_llama), recover_engine="fake")
    # What the vLLM worker generated was stored as vLLM sampled it — those it spooled and its successor delivered
    # included: full-length responses, aligned finite behaviour logprobs.
    from_vllm = trajectory_ids(out["first_events"].generated_groups)
    rows = [r for r in table.select(["trajectory_id", "response_token_ids", "behaviour_logprobs",
                                     "version_span_starts", "version_span_versions"]).to_pylist()
            if r["trajectory_id"] in from_vllm]
    assert len(rows) == len(from_vllm)
    for tokens, logprobs, starts, versions in ((r["response_token_ids"], r["behaviour_logprobs"],
                                                r["version_span_starts"], r["version_span_versions"]) for r in rows):
        assert len(tokens) == len(logprobs) == MAX_NEW_TOKENS
        assert all(math.isfinite(lp) and lp <= 0.0 for lp in logprobs)
        assert (starts, versions) == ([0], [0])


def test_replay_outage_with_fake_engine_loses_and_duplicates_nothing(tmp_path):
    run_outage(tmp_path, "fake")
