"""``gyre reward swap [--run RUN] CONFIG``: swap the reward functions of a running run's rollouts.

The swap is checked here first, before anything reaches the run (``reward_swaps.canonical_swap`` and
``check_swap`` against the task of ``{run_dir}/{run}/recipe.json``: rewards built, functions imported and their
signatures checked, each reward fitted to its task's first held-out entry); a relative ``file.py`` becomes an
absolute path against the current directory. The run's supervisor then applies it to every running rollout or to
none, and journals it (``services.control.commands.reward_swaps``). Exit 0 with the ``{task: reward_fn_version}`` now in
force; 2 when the swap is refused (here or by a rollout) or the run cannot be reached.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console


def add_parser(sub, ops_options) -> None:
    """``gyre reward swap`` (``ops_options``: the ops commands' ``--run/--namespace/--address/--run-dir``)."""
    reward = sub.add_parser("reward", help="change the reward functions of a running run")
    actions = reward.add_subparsers(dest="reward_command", required=True)
    swap = actions.add_parser(
        "swap", help="swap the reward of every rollout of a running run (groups started afterwards use it)",
        description="CONFIG: a YAML/JSON file or an inline YAML string: one reward ({name: ...} or "
                    "{function: 'file.py:fn'}, with weight, params), a list of them (weighted sum), or "
                    "{task: reward-or-list} for a mixture. Checked here first; applied to every rollout or none; "
                    "journaled in {run_dir}/{run}/reward_swaps.jsonl, so restarted and added rollouts and a resumed "
                    "run keep it. A file.py path must exist at that absolute path on every rollout node.")
    swap.add_argument("config", metavar="CONFIG", help="YAML/JSON file, or inline YAML")
    swap.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the run's answer")
    ops_options(swap, run_positional=False)


def main(args: argparse.Namespace, console: Console) -> int:
    """Check, send, wait; print the versions in force. 0 applied; 2 refused or unreachable."""
    from gyre.services.control.commands import ops
    from gyre.services.control.commands.reward_swaps import RewardSwapError, canonical_swap, check_swap, parse_swap_config
    from gyre.services.control.outputs.run_dir import RunDirError, task_config

    try:
        name, conn = ops.resolve_run(args.run, args.namespace, args.run_dir, args.address)
        try:
            task = task_config(Path(args.run_dir) / name)
        except RunDirError as exc:
            raise RewardSwapError(f"{exc}: the run's resolved recipe is needed to check the swap against its "
                                  "tasks; expected --run-dir to be the run's run_dir") from None
        swap = canonical_swap(parse_swap_config(args.config, Path.cwd()), task, Path.cwd())
        check_swap(swap, task)
        result = ops.reward_swap(ops.connect(name, args.namespace, conn), swap, args.timeout)
    except (RewardSwapError, ops.OpsError) as exc:
        console.print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
        return 2
    for warning in result.get("warnings", []):
        console.print(f"[yellow]warning:[/yellow] {warning}", highlight=False, soft_wrap=True)
    if not result["ok"]:
        console.print(f"[red]error:[/red] run {name}: {result['error']}; no rollout changed its reward, in force: "
                      f"{json.dumps(result['versions'])}", highlight=False, soft_wrap=True)
        return 2
    console.print(f"run {name}: reward swapped on {', '.join(result['rollouts']) or 'no running rollout'}; "
                  f"in force: {json.dumps(result['versions'])}", highlight=False, soft_wrap=True)
    return 0
