"""``gyre`` command line: ``gyre run RECIPE [--dry-run] [--set key=value ...]`` and
``gyre export CHECKPOINT OUT_DIR``."""

from __future__ import annotations

import argparse
import sys

import yaml
from rich.console import Console

from services.recipe import RecipeError, load_recipe


def _parse_sets(items: list[str]) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise RecipeError(f"--set {item!r}: expected KEY=VALUE, e.g. learner.num_steps=3")
        out[key] = yaml.safe_load(value)
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gyre", description="Asynchronous RL post-training as crash-tolerant services.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a recipe (YAML) end to end on Ray")
    run.add_argument("recipe")
    run.add_argument("--dry-run", action="store_true", help="validate the recipe and print the resolved plan")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="override a recipe value (dotted key, YAML value); repeatable")
    export = sub.add_parser("export", help="write a learner checkpoint as a Hugging Face model folder")
    export.add_argument("checkpoint", help="a checkpoints/global_step_N directory")
    export.add_argument("out_dir")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = Console()
    if args.command == "export":
        return _export(args.checkpoint, args.out_dir, console)
    try:
        recipe = load_recipe(args.recipe, _parse_sets(args.set))
    except RecipeError as exc:
        console.print(f"[red]error:[/red] {exc}", highlight=False)
        return 2
    if args.dry_run:
        from services.plan import describe

        console.print(describe(recipe), highlight=False)
        return 0
    from services.controller import run

    summary = run(recipe, console)
    console.print(f"done in {summary['wall_time_s']:.0f} s; outputs in {recipe.out_dir}", highlight=False)
    return 0


def _export(checkpoint: str, out_dir: str, console: Console) -> int:
    from learner.checkpoint import CheckpointError
    from services.export import export_checkpoint

    try:
        out = export_checkpoint(checkpoint, out_dir)
    except CheckpointError as exc:
        console.print(f"[red]error:[/red] {exc}", highlight=False)
        return 2
    console.print(f"exported {checkpoint} to {out}", highlight=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
