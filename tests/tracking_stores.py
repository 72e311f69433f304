"""Read back what the experiment trackers (``services.control.outputs.tracking``) wrote, each with its library's own
reader: TensorBoard's ``EventAccumulator``, MLflow's client, trackio's ``SQLiteStorage``, and W&B's offline run
file (``run-*.wandb``) decoded with W&B's own protobuf ``Record`` (wandb ships no Python reader for it: the
file is a LevelDB-style log of 32 KiB blocks, each record ``crc32 u32, length u16, type u8`` + its bytes)."""

from __future__ import annotations

import json
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path

WANDB_BLOCK = 32 * 1024
WANDB_HEADER = 7  # b":W&B" + magic u16 + version u8
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def tensorboard_scalars(log_dir: Path) -> dict[str, list[tuple[int, float, float]]]:
    """``{tag: [(step, value, wall_time), ...]}`` of every scalar in the event files under ``log_dir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {tag: [(e.step, e.value, e.wall_time) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def tensorboard_texts(log_dir: Path) -> dict[str, list[tuple[int, str]]]:
    """``{tag: [(step, text), ...]}`` of the text summaries (``add_text``) under ``log_dir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    acc.Reload()
    return {tag.removesuffix("/text_summary"): [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(tag)]
            for tag in acc.Tags()["tensors"] if tag.endswith("/text_summary")}


def mlflow_run(tracking_uri: str, run_id: str):
    """The ``mlflow.entities.Run`` and its client (``get_metric_history``, ``list_artifacts``, ...)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    return client.get_run(run_id), client


def mlflow_history(tracking_uri: str, run_id: str, key: str) -> list[tuple[int, float, int]]:
    """``[(step, value, timestamp ms), ...]`` of one metric, in step order."""
    _, client = mlflow_run(tracking_uri, run_id)
    return sorted((m.step, m.value, m.timestamp) for m in client.get_metric_history(run_id, key))


@dataclass
class WandbOfflineRun:
    """What one offline run file holds: its run record, config, history rows and final summary."""

    run_id: str
    project: str
    display_name: str
    group: str
    tags: list[str]
    config: dict = field(default_factory=dict)
    history: list[dict] = field(default_factory=list)
    summary: dict = field(default_factory=dict)
    exit_code: int | None = None


def _wandb_records(path: Path) -> list[bytes]:
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B run file"
    pos, out, partial = WANDB_HEADER, [], b""
    while pos + 7 <= len(data):
        left = WANDB_BLOCK - pos % WANDB_BLOCK
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        if pos + 7 + length > len(data):  # a record still being written
            break
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == FULL:
            out.append(chunk)
        elif kind == FIRST:
            partial = chunk
        elif kind == MIDDLE:
            partial += chunk
        elif kind == LAST:
            out.append(partial + chunk)
    return out


def _item_key(item) -> str:
    return item.key or "/".join(item.nested_key)


def wandb_offline_runs(root: Path, wait_s: float = 60.0) -> list[WandbOfflineRun | None]:
    """Every ``{root}/wandb/offline-run-*/run-*.wandb``, decoded, oldest first (``None`` for a file without its
    run record). W&B's service process writes the file on its own schedule: ``run.finish()`` can return before
    the last records reach the disk (seen on this machine under load: a file of its 7-byte header only), so this
    waits up to ``wait_s`` seconds for every file to hold its run's ``exit`` record, then returns what is there."""
    deadline = time.monotonic() + wait_s
    while True:
        runs = [_decode_wandb_file(path) for path in sorted(Path(root).glob("wandb/offline-run-*/run-*.wandb"))]
        if all(r is not None and r.exit_code is not None for r in runs) or time.monotonic() > deadline:
            return runs
        time.sleep(0.2)


def _decode_wandb_file(path: Path) -> WandbOfflineRun | None:
    from wandb.proto import wandb_internal_pb2 as pb

    run = None
    for raw in _wandb_records(path):
        record = pb.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            r = record.run
            run = WandbOfflineRun(r.run_id, r.project, r.display_name, r.run_group, list(r.tags))
            run.config.update({_item_key(i): json.loads(i.value_json) for i in r.config.update})
        elif run is None:
            continue
        elif kind == "config":
            run.config.update({_item_key(i): json.loads(i.value_json) for i in record.config.update})
        elif kind == "history":
            run.history.append({_item_key(i): json.loads(i.value_json) for i in record.history.item})
        elif kind == "summary":
            run.summary.update({_item_key(i): json.loads(i.value_json) for i in record.summary.update})
        elif kind == "exit":
            run.exit_code = record.exit.exit_code
    return run


def trackio_logs(project: str, run: str) -> tuple[list[dict], dict]:
    """``(rows, config)`` of a trackio run in the store of ``TRACKIO_DIR`` (tests/conftest.py sets it)."""
    from trackio.sqlite_storage import SQLiteStorage

    return SQLiteStorage.get_logs(project, run), SQLiteStorage.get_run_config(project, run)
