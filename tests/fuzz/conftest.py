"""Hypothesis profiles for the fuzz suite.

``ci`` (the default) is derandomized — the same examples on every run, no example database — and
sized so the whole of ``tests/fuzz`` stays well under 90 s on a busy 2-core machine. ``dev`` draws
fresh random examples and more of them: ``HYPOTHESIS_PROFILE=dev pytest tests/fuzz`` when hunting.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

settings.register_profile("ci", derandomize=True, database=None, max_examples=25, print_blob=True, **_COMMON)
settings.register_profile("dev", max_examples=300, **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
