"""What the whole-system benches share: a working folder and a stdout that carries only the JSON line."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def run_quietly(measure: Callable[[Path], T], dir: str | None, prefix: str) -> T:
    """``measure(root)`` with file descriptor 1 pointed at stderr, so that what the services print (structlog, Ray,
    DeepSpeed, vLLM) cannot mix with the bench's JSON line on stdout. ``root`` is ``dir``, or a new temporary
    folder named ``{prefix}…`` that is removed afterwards (``dir`` is kept)."""
    root = Path(dir) if dir else Path(tempfile.mkdtemp(prefix=prefix))
    stdout = os.dup(1)
    os.dup2(2, 1)
    try:
        return measure(root)
    finally:
        sys.stdout.flush()
        os.dup2(stdout, 1)
        os.close(stdout)
        if not dir:
            shutil.rmtree(root, ignore_errors=True)
