"""``gyre`` command line.

``gyre run RECIPE [--dry-run] [--set key=value ...] [--resume auto|none|PATH] [--force-resume]``,
``gyre export CHECKPOINT OUT_DIR``, ``gyre eval MODEL_OR_CHECKPOINT RECIPE [--set key=value ...] [--out DIR]``,
``gyre report RUN``, ``gyre check RUN_DIR``, ``gyre sweep [status] SWEEP.yaml`` (``services.cli.sweep``),
``gyre compare RUN_DIR... [--by KEY]`` (``services.cli.compare``), and against a running run:
``gyre status RUN``, ``gyre scale rollout N``, ``gyre restart SERVICE``, ``gyre checkpoint``,
``gyre reward swap CONFIG`` (``services.cli.reward``).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import signal
import sys
from pathlib import Path

import yaml
from rich.console import Console

from gyre.services.cli import compare, reward, sweep
from gyre.services.control.recipe.machine_check import check_machine
from gyre.services.control.recipe.schema import RecipeError, load_recipe


def _parse_sets(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise RecipeError(f"--set {item!r}: expected KEY=VALUE, e.g. learner.num_steps=3")
        out[key] = yaml.safe_load(value)
    return out


def _ops_options(p: argparse.ArgumentParser, run_positional: bool) -> None:
    if run_positional:
        p.add_argument("run", help="run name (the recipe's name)")
    else:
        p.add_argument("--run", help="run name (default: the only run running in the namespace)")
    p.add_argument("--namespace", default="gyre", help="Ray namespace of the run (recipe ray.namespace)")
    p.add_argument("--address", help="Ray address (default: the one in {run_dir}/{run}/ray_connection.json, "
                                      "with its auth settings; else auto)")
    p.add_argument("--run-dir", default="runs", help="where run directories are (recipe run_dir)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gyre", description="Asynchronous RL post-training as crash-tolerant services.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run (or resume) a recipe (YAML) end to end on Ray")
    run.add_argument("recipe")
    run.add_argument("--dry-run", action="store_true",
                     help="validate the recipe and print the resolved plan, placement and the learner's memory per rank")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="override a recipe value (dotted key, YAML value); repeatable")
    run.add_argument("--resume", default="auto", metavar="auto|none|PATH",
                     help="auto: continue the run in its directory; none: archive it and start fresh; "
                          "PATH: resume the learner from that checkpoint")
    run.add_argument("--force-resume", action="store_true",
                     help="resume even if the checkpoint's task/dataset fingerprint differs")
    export = sub.add_parser("export", help="write a learner checkpoint as a Hugging Face model folder")
    export.add_argument("checkpoint", help="a checkpoints/global_step_N directory")
    export.add_argument("out_dir")
    ev = sub.add_parser("eval", help="the recipe's held-out evaluation of a model folder or learner checkpoint")
    ev.add_argument("model", metavar="MODEL_OR_CHECKPOINT", help="an HF model folder or checkpoints/global_step_N")
    ev.add_argument("recipe", help="the recipe whose task, eval: section and engine settings to use")
    ev.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a recipe value, e.g. eval.n_samples=8; repeatable")
    ev.add_argument("--out", help="output folder (default: {run_dir}/{name}/standalone-eval)")
    report = sub.add_parser("report", help="PNG plots of a run: reward, accuracy, staleness, throughput, time breakdown")
    report.add_argument("run")
    report.add_argument("--run-dir", default="runs")
    sweep.add_parser(sub)
    compare.add_parser(sub)
    check = sub.add_parser("check", help="check a finished run's invariants (journals + replay); exit 1 on violations")
    check.add_argument("run_dir", help="the run directory (runs/<name>)")
    status = sub.add_parser("status", help="services, versions, lag, throughput, restarts of a running run")
    _ops_options(status, run_positional=True)
    status.add_argument("--json", action="store_true", help="print the status as JSON")
    scale = sub.add_parser("scale", help="set the number of rollout services of a running run")
    scale.add_argument("role", choices=["rollout"])
    scale.add_argument("count", type=int)
    _ops_options(scale, run_positional=False)
    restart = sub.add_parser("restart", help="kill and recreate one service of a running run")
    restart.add_argument("service", help="replay, learner or rollout-N")
    _ops_options(restart, run_positional=False)
    ckpt = sub.add_parser("checkpoint", help="emergency learner checkpoint of a running run, after the current step")
    _ops_options(ckpt, run_positional=False)
    reward.add_parser(sub, _ops_options)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = Console()
    if args.command == "export":
        return _export(args.checkpoint, args.out_dir, console)
    if args.command == "eval":
        return _eval(args, console)
    if args.command == "report":
        return _report(Path(args.run_dir) / args.run, console)
    if args.command == "check":
        return _check(args.run_dir, console)
    if args.command == "sweep":
        return sweep.main(args, console)
    if args.command == "compare":
        return compare.main(args, console)
    if args.command == "reward":
        return reward.main(args, console)
    if args.command in ("status", "scale", "restart", "checkpoint"):
        return _ops(args, console)
    _let_sigint_stop_the_driver()
    try:
        if args.resume not in ("auto", "none") and not Path(args.resume).is_dir():
            raise RecipeError(f"--resume {args.resume!r}: expected auto, none or an existing checkpoint directory")
        resume = {"learner.resume": args.resume, "learner.force_resume": args.force_resume}
        overrides = _parse_sets(args.set) | resume
        recipe = load_recipe(args.recipe, overrides, dry_run=True)  # downloads nothing
        if not args.dry_run:
            check_machine(recipe)  # before a model download, not after
            recipe = load_recipe(args.recipe, overrides)
    except RecipeError as exc:
        console.print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
        return 2
    if args.dry_run:
        from gyre.services.control.recipe.plan import describe

        console.print(describe(recipe), highlight=False)
        return 0
    from gyre.services.control.orchestration.controller import run
    from gyre.services.control.outputs.run_lock import RunDirBusyError

    _dump_stacks_on_sigusr2()
    try:
        summary = run(recipe, console)
    except RunDirBusyError as exc:
        console.print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
        return 2
    if not summary.get("already_finished"):
        console.print(f"done in {summary['wall_time_s']:.0f} s; outputs in {recipe.out_dir}", highlight=False)
    return 0


def _let_sigint_stop_the_driver() -> None:
    """Make Ctrl-C (SIGINT) raise ``KeyboardInterrupt`` in ``gyre run``'s main thread, whatever the driver
    inherited: a non-interactive shell starts a background job (``gyre run ... &``, ``make test > log &``) with
    SIGINT ignored, that disposition survives ``exec``, and Python then installs no ``KeyboardInterrupt`` handler,
    so the driver went on supervising after a Ctrl-C. A SIGINT blocked by the parent (the signal mask is
    inherited too) is unblocked for the same reason."""
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _sigint_state() -> str:
    """How this process handles SIGINT: Python's handler, and the kernel's view (``/proc/self/status``; the
    blocked mask is the calling thread's) for a handler a native library may have replaced underneath Python."""
    try:
        lines = Path("/proc/self/status").read_text().splitlines()
    except OSError:
        lines = []
    kernel = " ".join(line.replace(":\t", "=") for line in lines
                      if line.startswith(("SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt")))
    return f"SIGINT handler: {signal.getsignal(signal.SIGINT)!r}; {kernel or 'no /proc/self/status'} (SIGINT: 0x2)"


def _dump_stacks_on_sigusr2() -> None:
    """``kill -USR2 <driver pid>`` prints every thread's Python stack to stderr (a driver that seems stuck, e.g.
    one that does not stop on Ctrl-C) at once, from faulthandler's C handler; it then chains to a Python
    handler that prints ``_sigint_state()`` when the main thread next runs Python code. The run goes on."""
    signal.signal(signal.SIGUSR2, lambda *_: print(_sigint_state(), file=sys.stderr, flush=True))
    faulthandler.register(signal.SIGUSR2, all_threads=True, chain=True)


def _ops(args: argparse.Namespace, console: Console) -> int:
    from gyre.services.control.commands import ops

    try:
        name, conn = ops.resolve_run(args.run, args.namespace, args.run_dir, args.address)
        state = ops.connect(name, args.namespace, conn)
        if args.command == "status":
            st = ops.status(state)
            text = json.dumps(st, indent=2) if args.json else ops.format_status(st)
            console.print(text, highlight=False, soft_wrap=True)  # one line per service, never wrapped
        elif args.command == "scale":
            before = ops.scale(state, args.role, args.count)
            console.print(f"run {name}: rollouts {before} → {args.count} (applied on the next supervisor tick)",
                          highlight=False)
        elif args.command == "restart":
            ops.restart(state, args.service)
            console.print(f"run {name}: restart of {args.service} requested", highlight=False)
        else:
            ops.checkpoint(state)
            console.print(f"run {name}: emergency checkpoint requested (after the current step)", highlight=False)
    except ops.OpsError as exc:
        console.print(f"[red]error:[/red] {exc}", highlight=False)
        return 2
    return 0


def _eval(args: argparse.Namespace, console: Console) -> int:
    """``gyre eval``: exit 0 with the table printed, 2 for a bad recipe, target or checkpoint."""
    from gyre.learner.checkpoint.store import CheckpointError
    from gyre.services.cli.standalone_eval import EvalTargetError, run_standalone

    try:
        overrides = _parse_sets(args.set)
        load_recipe(args.recipe, overrides, dry_run=True)  # a bad recipe is refused before any export
        run_standalone(args.model, lambda folder: load_recipe(args.recipe, overrides | {"model": folder, "model_revision": None}),
                       args.out, console)
    except (RecipeError, EvalTargetError, CheckpointError) as exc:
        console.print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
        return 2
    return 0


def _report(run_dir: Path, console: Console) -> int:
    from gyre.services.control.outputs.report import plot_report

    try:
        paths = plot_report(run_dir / "metrics.jsonl", run_dir / "report")
    except (FileNotFoundError, ValueError) as exc:
        console.print(f"[red]error:[/red] {exc}", highlight=False)
        return 2
    console.print("wrote " + ", ".join(str(p) for p in paths), highlight=False)
    return 0


def _check(run_dir: str, console: Console) -> int:
    """Print ``services.cli.invariants.check_run``'s report as JSON; 0 ok, 1 violations, 2 unreadable run dir."""
    from contextlib import redirect_stdout

    from gyre.services.cli.invariants import RunDirError, check_run

    try:
        with redirect_stdout(sys.stderr):  # replay's restore logs; stdout carries only the report JSON
            report = check_run(run_dir)
    except RunDirError as exc:
        console.print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
        return 2
    print(report.to_json())
    return 0 if report.ok else 1


def _export(checkpoint: str, out_dir: str, console: Console) -> int:
    from gyre.learner.checkpoint.store import CheckpointError
    from gyre.services.cli.export import export_checkpoint

    try:
        out = export_checkpoint(checkpoint, out_dir)
    except CheckpointError as exc:
        console.print(f"[red]error:[/red] {exc}", highlight=False)
        return 2
    console.print(f"exported {checkpoint} to {out}", highlight=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
