"""``ray up`` → ``ray submit`` → ``ray down`` with ``deploy/local-cluster.yaml`` against an sshd on loopback.

The "remote" head is this machine, reached over ssh (keys generated here) inside its own PID/mount
namespace (see ``tests/deploy/sshnode.py``). Skipped, with the reason, where openssh-server/rsync cannot be
installed or namespaces cannot be created.

The recipe's rollout runs the simulated engine (``tests.engines``): the launcher is tested, not vLLM.
"""

import json
import shutil
import tempfile
import uuid
from pathlib import Path

import pytest

from tests.deploy.raycluster import forget_local_cluster, pick_head_ports, ray_cli, render_local_cluster
from tests.deploy.sshnode import PACKAGES, LoopbackNode
from tests.deploy.system import ensure_debian_packages, pid_namespace_problem, ray_session_logs, tail_file, tail_text
from tests.engines import sim_engine_sets
from tests.training import assert_trained

pytestmark = pytest.mark.slow

RECIPE = "deploy/recipes/tiny-cluster.yaml"


def _explain(step, proc, node, ports) -> str:
    return (f"`ray {step}` exited {proc.returncode}\n--- stdout\n{tail_text(proc.stdout, 60)}\n--- stderr\n"
            f"{tail_text(proc.stderr, 30)}\n--- sshd\n{tail_file(node.log, 10)}\n{ray_session_logs(ports.temp_dir)}")


@pytest.fixture
def loopback_node():
    reason = ensure_debian_packages(PACKAGES) or pid_namespace_problem()
    if reason:
        pytest.skip(reason)
    root = Path(tempfile.mkdtemp(prefix="gyre-node-", dir="/tmp"))
    node = LoopbackNode(root)
    try:
        node.start()
    except RuntimeError as exc:
        node.stop()
        shutil.rmtree(root, ignore_errors=True)
        pytest.skip(f"sshd cannot run here: {exc}")
    yield node
    node.stop()
    shutil.rmtree(root, ignore_errors=True)


def test_ray_up_submit_down(loopback_node, tiny_llama, tmp_path):
    node, ports, name = loopback_node, pick_head_ports(), f"gyre-test-{uuid.uuid4().hex[:8]}"
    config = str(render_local_cluster(node, ports, name, tmp_path / "cluster.yaml"))
    run_dir, downed = tmp_path / "runs", False
    try:
        up = ray_cli(["up", "-y", "--no-config-cache", "--disable-usage-stats", config], timeout_s=240)
        assert up.returncode == 0, _explain("up", up, node, ports)
        # setup_commands ran on the node: its ~/.bashrc (in the node's temp home) carries the gyre env line.
        assert "# gyre cluster env" in (node.home / ".bashrc").read_text()

        submit = ray_cli(["submit", "--no-config-cache", config, "deploy/ray_entry.py", "--", RECIPE,
                          "--set", f"model={tiny_llama}", "--set", f"run_dir={run_dir}", *sim_engine_sets()], timeout_s=420)
        assert submit.returncode == 0, _explain("submit", submit, node, ports)
        assert (node.home / "ray_entry.py").is_file()  # ray submit copied the entry to the head's ~

        out = run_dir / "tiny-cluster"
        summary = json.loads((out / "summary.json").read_text())
        assert summary["final_version"] == 1
        # the recipe's learner is two DeepSpeed ranks in a placement group: both wrote the final checkpoint
        assert json.loads((out / "checkpoints" / "global_step_1" / "metadata.json").read_text())["world_size"] == 2
        assert [r["step"] for r in assert_trained(out, tiny_llama, min_fraction=1.0)] == [1]  # it trained
        assert json.loads((out / "recipe.json").read_text())["ray"]["address"] == "auto"
        # The run's driver joined *this* head: its core-driver log is in the head's session.
        drivers = list((ports.temp_dir / "session_latest" / "logs").glob("python-core-driver-*"))
        assert drivers, ray_session_logs(ports.temp_dir)

        down = ray_cli(["down", "-y", config], timeout_s=120)
        downed = True
        assert down.returncode == 0, _explain("down", down, node, ports)
        # `ray down` ran `ray stop` on the head: no Ray process is left in the node.
        left = node.ssh("pgrep -l -x 'gcs_server|raylet' || true")
        assert left.stdout.strip() == "", f"Ray still running on the node after `ray down`:\n{left.stdout}"
    finally:
        if not downed:
            ray_cli(["down", "-y", config], timeout_s=120)
        forget_local_cluster(name)
        node.stop()
        shutil.rmtree(ports.temp_dir, ignore_errors=True)
