"""The crash matrix's replay and rollout run (``tests/fault/test_crash_matrix.py`` holds the matrix and the
learner run): a file of its own so that pytest-xdist's ``--dist loadfile`` can run the two whole runs on both
workers at once."""

import pytest

from tests.fault.test_crash_matrix import check_matrix_run

pytestmark = pytest.mark.slow


def test_crash_matrix_replay_rollout(tiny_llama, tmp_path):
    check_matrix_run("replay-rollout", tiny_llama, tmp_path)
