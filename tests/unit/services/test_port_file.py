"""``services.common.port_file``: a server process's bound port handed to its starter through a file."""

import subprocess
import sys

import pytest

from gyre.services.common import port_file


class _Running:
    def poll(self):
        return None


def test_the_written_port_is_read_back_and_no_temp_file_is_left(tmp_path):
    port_file.write(tmp_path / "port", 43125)
    assert port_file.wait(tmp_path / "port", _Running(), timeout_s=1.0) == 43125
    assert [p.name for p in tmp_path.iterdir()] == ["port"]


def test_a_process_that_exits_before_writing_its_port_is_named_with_its_exit_code(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    proc.wait()
    with pytest.raises(RuntimeError, match=r"^server process exited with 3 before writing its port to .*port$"):
        port_file.wait(tmp_path / "port", proc, timeout_s=5.0)


def test_a_port_never_written_times_out(tmp_path):
    with pytest.raises(TimeoutError, match=r"^no port in .*port after 0.2 s$"):
        port_file.wait(tmp_path / "port", _Running(), timeout_s=0.2)
