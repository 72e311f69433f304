"""structlog JSON lines of a gyre service: run id, service, policy version, stdlib routing."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import threading
from datetime import datetime, timedelta, timezone

import pytest
import structlog

from gyre.services.common import logs
from gyre.services.common.logs import HANDLER_NAME, ROUTED_LOGGERS, bind_policy_version, configure_logging


@pytest.fixture(autouse=True)
def restore_logging(monkeypatch):
    """Undo everything ``configure_logging`` changes: structlog config, stdlib handlers and levels,
    the process-wide fields and ``VLLM_CONFIGURE_LOGGING``."""
    monkeypatch.delenv("VLLM_CONFIGURE_LOGGING", raising=False)
    monkeypatch.setattr(logs, "_policy_version", None)
    monkeypatch.setattr(logs, "_fields", {})
    saved_config = structlog.get_config()
    names = ("", *ROUTED_LOGGERS)
    saved = {n: (list(logging.getLogger(n).handlers), logging.getLogger(n).level, logging.getLogger(n).propagate)
             for n in names}
    yield
    structlog.configure(**saved_config)
    for n, (handlers, level, propagate) in saved.items():
        lg = logging.getLogger(n)
        lg.handlers[:] = handlers
        lg.setLevel(level)
        lg.propagate = propagate


def lines(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_json_lines_carry_run_id_service_policy_version_and_utc_time():
    out = io.StringIO()
    configure_logging("run-7", "learner", stream=out)
    log = structlog.get_logger("learner")
    log.info("resumed", step=40)
    bind_policy_version(41)
    log.warning("checkpoint_slow", seconds=12.5)
    first, second = lines(out)
    assert first == {"event": "resumed", "step": 40, "level": "info", "run_id": "run-7", "service": "learner",
                     "policy_version": None, "timestamp": first["timestamp"]}
    assert (second["event"], second["level"], second["policy_version"], second["seconds"]) == (
        "checkpoint_slow", "warning", 41, 12.5)
    stamp = datetime.fromisoformat(first["timestamp"])
    assert first["timestamp"].endswith("Z") and stamp.utcoffset() == timedelta(0)
    assert abs(datetime.now(timezone.utc) - stamp) < timedelta(minutes=5)


def test_policy_version_reaches_other_threads_and_earlier_tasks_and_can_be_scoped():
    out = io.StringIO()
    configure_logging("run-7", "rollout-0", stream=out)
    log = structlog.get_logger()

    async def main():
        ready, go = asyncio.Event(), asyncio.Event()

        async def group_task():  # created before the bind: its context copy predates it
            ready.set()
            await go.wait()
            log.info("group_done")

        task = asyncio.create_task(group_task())
        await ready.wait()
        thread = threading.Thread(target=bind_policy_version, args=(12,))  # e.g. the weight subscriber
        thread.start()
        thread.join()
        go.set()
        await task

    asyncio.run(main())
    with structlog.contextvars.bound_contextvars(policy_version=11):
        log.info("scored_under_old_version")
    log.info("after_scope")
    assert [(r["event"], r["policy_version"]) for r in lines(out)] == [
        ("group_done", 12), ("scored_under_old_version", 11), ("after_scope", 12)]


def test_level_filters_gyre_events():
    out = io.StringIO()
    configure_logging("r", "replay", level="warning", stream=out)
    log = structlog.get_logger()
    log.info("quiet")
    log.debug("quieter")
    log.error("wal_failed", path="/x")
    assert [r["event"] for r in lines(out)] == ["wal_failed"]


def test_stdlib_records_of_libraries_are_rendered_as_json_at_warning():
    stray = logging.StreamHandler(io.StringIO())
    logging.getLogger("DeepSpeed").addHandler(stray)  # DeepSpeed installs its own handler at import
    out = io.StringIO()
    configure_logging("run-7", "learner", stream=out)
    bind_policy_version(3)
    logging.getLogger("vllm.v1.engine").warning("KV cache %d%% full", 97)
    logging.getLogger("DeepSpeed").error("overflow")
    logging.getLogger("some.lib").info("chatty")  # below WARNING: dropped
    records = lines(out)
    assert [(r["logger"], r["event"], r["level"]) for r in records] == [
        ("vllm.v1.engine", "KV cache 97% full", "warning"), ("DeepSpeed", "overflow", "error")]
    assert all(r["run_id"] == "run-7" and r["service"] == "learner" and r["policy_version"] == 3 for r in records)
    assert stray not in logging.getLogger("DeepSpeed").handlers and stray.stream.getvalue() == ""
    assert logs.os.environ["VLLM_CONFIGURE_LOGGING"] == "0"


def test_exceptions_become_a_string_field():
    out = io.StringIO()
    configure_logging("r", "learner", stream=out)
    try:
        1 / 0
    except ZeroDivisionError:
        structlog.get_logger().exception("step_failed")
        logging.getLogger("ray").exception("actor died")
    gyre, ray = lines(out)
    assert gyre["event"] == "step_failed" and "ZeroDivisionError: division by zero" in gyre["exception"]
    assert ray["logger"] == "ray" and "ZeroDivisionError" in ray["exception"]


def test_reconfiguring_replaces_the_handler_and_console_mode_is_not_json():
    first, second = io.StringIO(), io.StringIO()
    configure_logging("r", "learner", stream=first)
    configure_logging("r", "learner", json=False, stream=second)
    assert [h.get_name() for h in logging.getLogger().handlers].count(HANDLER_NAME) == 1
    structlog.get_logger().info("weights_applied", version=5)
    logging.getLogger("x").warning("stdlib too")
    assert first.getvalue() == ""
    text = second.getvalue().splitlines()
    assert len(text) == 2 and "weights_applied" in text[0] and "run_id=r" in text[0] and "version=5" in text[0]
    assert "stdlib too" in text[1] and not text[0].startswith("{")


def test_bad_arguments_are_clear_errors():
    with pytest.raises(ValueError, match=r"log level 'verbose' is not one of \['debug', 'info'"):
        configure_logging("r", "learner", level="verbose")
    with pytest.raises(ValueError, match="service must be a non-empty string; got ''"):
        configure_logging("r", "")
    with pytest.raises(ValueError, match="policy version must be an int >= 0; got '3'"):
        bind_policy_version("3")


def test_a_log_dir_gets_the_same_lines_in_the_services_own_file(tmp_path, monkeypatch):
    monkeypatch.delenv(logs.LOG_DIR_ENV, raising=False)
    out = io.StringIO()
    configure_logging("run-7", "rollout-2", stream=out, log_dir=tmp_path / "logs")
    structlog.get_logger("rollout").info("weights_applied", version=3)
    logging.getLogger("vllm").warning("engine slow")  # library records reach the file too
    written = (tmp_path / "logs" / "rollout-2.log").read_text().splitlines()
    assert [json.loads(line) for line in written] == lines(out)
    assert [json.loads(line)["event"] for line in written] == ["weights_applied", "engine slow"]


def test_the_log_dir_comes_from_the_environment_the_controller_sets(tmp_path, monkeypatch):
    monkeypatch.setenv(logs.LOG_DIR_ENV, str(tmp_path))
    configure_logging("run-7", "replay", stream=io.StringIO())
    structlog.get_logger("replay").info("restored", groups=0)
    configure_logging("run-7", "replay", stream=io.StringIO())  # a restarted service appends, never truncates
    structlog.get_logger("replay").info("restored", groups=5)
    assert [json.loads(line)["groups"] for line in (tmp_path / "replay.log").read_text().splitlines()] == [0, 5]
