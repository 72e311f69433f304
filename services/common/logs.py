"""structlog set-up of a gyre service: one JSON object per line carrying ``run_id``, ``service`` and
``policy_version``, with the libraries' stdlib logging (vLLM, DeepSpeed, Ray) rendered the same way.

A line looks like::

    {"run_id": "r7", "service": "rollout-0", "policy_version": 12, "level": "info",
     "timestamp": "2026-11-22T08:14:13.123456Z", "event": "weights_applied", "version": 12, "seconds": 0.7}

``policy_version`` is process-wide, not a ``contextvars`` binding: the learner trains in an actor's
worker thread and a rollout applies weights from its subscriber thread, while ``contextvars`` values
stay in the thread or asyncio task (and the tasks copied from it) that bound them, so the other
threads and earlier tasks would log a stale or missing version. A scoped
``structlog.contextvars.bound_contextvars(policy_version=v)`` still overrides it for its scope (e.g. a
group generated under version ``v``); other context variables are merged as usual.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import TextIO

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR, "critical": logging.CRITICAL}
HANDLER_NAME = "gyre"
"""Name of the stdlib handler ``configure_logging`` installs (and replaces on a second call)."""
ROUTED_LOGGERS = ("vllm", "DeepSpeed", "ray")
"""Library loggers that install their own handler and do not propagate: ``configure_logging`` gives
them the gyre handler instead, at ``WARNING`` (or ``level`` if higher)."""

LOG_DIR_ENV = "GYRE_LOG_DIR"
"""Environment variable naming the directory of per-service log files; the controller sets it to
``{run_dir}/{name}/logs`` for every service it starts, so each writes ``{service}.log`` there too."""

_fields: dict[str, object] = {}
_policy_version: int | None = None


def bind_policy_version(version: int) -> None:
    """Set the policy version every later log line of this process carries (learner: after each
    publish; rollout: after each applied version). Raises ``ValueError`` unless an int >= 0."""
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(f"policy version must be an int >= 0; got {version!r}")
    global _policy_version
    _policy_version = version


def _add_service_fields(logger, method_name: str, event_dict: dict) -> dict:
    """structlog processor: ``run_id``, ``service`` and ``policy_version`` (None before any bind)."""
    for key, value in _fields.items():
        event_dict.setdefault(key, value)
    event_dict.setdefault("policy_version", _policy_version)
    return event_dict


class _Tee:
    """A text stream writing every line to the console stream and to an append-only log file."""

    def __init__(self, primary: TextIO, file: TextIO) -> None:
        self.primary, self.file = primary, file

    def write(self, text: str) -> int:
        self.primary.write(text)
        self.file.write(text)
        return len(text)

    def flush(self) -> None:
        self.primary.flush()
        self.file.flush()

    def isatty(self) -> bool:
        return self.primary.isatty()


def log_file_path(log_dir: str | Path, service: str) -> Path:
    """The log file of ``service`` under ``log_dir``: ``{log_dir}/{service}.log``."""
    return Path(log_dir) / f"{service}.log"


def configure_logging(run_id: str, service: str, json: bool = True, level: str = "info",
                      stream: TextIO | None = None, log_dir: str | Path | None = None) -> logging.Handler:
    """Configure structlog (and stdlib logging) for this process; call once at service start (a second
    call replaces the first).

    Args:
        run_id: the run's id, on every line.
        service: ``learner``, ``replay``, ``rollout-0``…, on every line.
        json: JSON lines (``structlog.processors.JSONRenderer``); ``False``: coloured console lines
            (``structlog.dev.ConsoleRenderer``, rich tracebacks).
        level: lowest level of gyre's own events (``debug`` … ``critical``).
        stream: where lines go; default ``sys.stderr`` (at call time).
        log_dir: also append every line to ``{log_dir}/{service}.log`` (created if missing; line-buffered, so a
            crash loses at most the line being written). Default: ``$GYRE_LOG_DIR`` if set, else no file.

    Stdlib records (root logger and ``ROUTED_LOGGERS``) at ``WARNING`` or above (or ``level`` if higher)
    are rendered by the same processors, with their ``logger`` name. ``VLLM_CONFIGURE_LOGGING`` is set
    to ``0`` unless already set, so a later ``import vllm`` keeps this set-up.

    Returns:
        The stdlib handler installed (named ``HANDLER_NAME``).

    Raises:
        ValueError: empty ``run_id``/``service`` or an unknown ``level``.
    """
    for name, value in (("run_id", run_id), ("service", service)):
        if not isinstance(value, str) or not value:
            raise ValueError(f"{name} must be a non-empty string; got {value!r}")
    if level not in _LEVELS:
        raise ValueError(f"log level {level!r} is not one of {list(_LEVELS)}")
    stream = sys.stderr if stream is None else stream
    log_dir = log_dir if log_dir is not None else os.environ.get(LOG_DIR_ENV) or None
    if log_dir is not None:
        path = log_file_path(log_dir, service)
        path.parent.mkdir(parents=True, exist_ok=True)
        stream = _Tee(stream, open(path, "a", buffering=1, encoding="utf-8"))  # noqa: SIM115 (the process's life)
    _fields.clear()
    _fields.update(run_id=run_id, service=service)
    shared = [structlog.contextvars.merge_contextvars, structlog.processors.add_log_level,
              structlog.processors.TimeStamper(fmt="iso", utc=True, key="timestamp"), _add_service_fields]
    if json:  # tracebacks become an "exception" string field
        shared.append(structlog.processors.format_exc_info)
        renderer = structlog.processors.JSONRenderer()
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=stream.isatty())
    structlog.configure(
        processors=[*shared, structlog.processors.StackInfoRenderer(), renderer],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
    return _route_stdlib(stream, shared, renderer, max(logging.WARNING, _LEVELS[level]))


def _route_stdlib(stream: TextIO, shared: list, renderer, level: int) -> logging.Handler:
    """Install one handler rendering stdlib records through ``shared`` + ``renderer`` on the root
    logger and ``ROUTED_LOGGERS`` (replacing a previous gyre handler and the libraries' own ones)."""
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    handler = logging.StreamHandler(stream)
    handler.set_name(HANDLER_NAME)
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[structlog.stdlib.add_logger_name, *shared],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer]))
    root = logging.getLogger()
    for h in [h for h in root.handlers if h.get_name() == HANDLER_NAME]:
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level)
    for name in ROUTED_LOGGERS:
        lib = logging.getLogger(name)
        for h in list(lib.handlers):
            lib.removeHandler(h)
        lib.addHandler(handler)
        lib.setLevel(level)
        lib.propagate = False
    return handler
