"""A run that trains from a recording (``replay.source: {recorded: RUN_DIR}``; record once, train many).

The recording is a finished run's directory: its ``recipe.json`` (whose ``replay`` section is the config its
replay ran with) and its replay directory, read by ``replay.recorded.read_recording`` into the groups its learner
consumed, in the recorded order. What the controller does differently for such a run:

- ``check_recorded_source`` (when the recipe loads): the recording reads whole and verified, is not this run's own
  directory, and the run is not ``determinism: lockstep`` (which fixes its own prompts per step).
- ``use_recording`` (at ``gyre run`` start, in the run directory): this run's replay directory is built from the
  recording (``replay.recorded.write_replay_dir``; re-used as it is when the run resumes), and the run goes on
  with the derived replay config (no staleness gate) and ``learner.num_steps`` lowered to the steps the recording
  fills (a partial batch at its end is not trained).
- ``rollouts_to_start``: rollouts run for evaluation only (one, when the recipe evaluates at all; none otherwise)
  and the controller never starts their generation, so no training group is generated.
"""

from __future__ import annotations

from pathlib import Path

import structlog

from gyre.replay.config import ReplayConfig
from gyre.services.control.outputs.run_dir import RunDirError, replay_config
from gyre.replay.recorded import (Recording, RecordingError, read_manifest, read_recording, recorded_replay_config,
                             write_replay_dir)

log = structlog.get_logger("controller")

__all__ = ["RecordingError", "check_recorded_source", "recorded_replay", "rollouts_to_start", "use_recording"]

ORDER = "consumed"
"""The recorded order a run's ``recording.json`` names: the recorded learner's acknowledged leases, in lease order."""


def recorded_replay(run_dir: str | Path) -> ReplayConfig:
    """The replay config the recorded run ``run_dir`` ran with (its ``recipe.json``), ``dir`` set to its replay
    directory (``replay.dir``, else ``{run_dir}/replay``).

    Raises:
        RecordingError: not a run directory (no ``recipe.json``), or its replay section does not load.
    """
    try:
        return replay_config(run_dir, kind="recorded run's directory")
    except RunDirError as exc:
        raise RecordingError(str(exc)) from None


def _replay_dir(recipe) -> Path:
    """This run's own replay directory (as ``services.control.orchestration.factory.ServiceFactory`` places it)."""
    return Path(recipe.replay.dir) if recipe.replay.dir else recipe.out_dir.resolve() / "replay"


def check_recorded_source(recipe) -> Recording | None:
    """Validate ``recipe.replay.source`` (a ``services.control.recipe.schema.Recipe``); returns the recording it names read
    whole (``replay.recorded.read_recording``), or ``None`` without a source.

    Raises:
        RecordingError: lockstep; the recording is this run's own directory or holds this run's replay directory;
            or it does not read (missing, incomplete or corrupt; ``read_recording``), naming the path.
    """
    source = recipe.replay.source
    if source is None:
        return None
    if recipe.determinism == "lockstep":
        raise RecordingError("determinism: lockstep cannot train from a recording: lockstep fixes which prompts each "
                             "step trains, a recording already fixed which groups (leave determinism: async)")
    run_dir = Path(source.recorded)
    if run_dir == recipe.out_dir.resolve():
        raise RecordingError(f"{run_dir} is this run's own directory; name another run's directory")
    cfg = recorded_replay(run_dir)
    if _replay_dir(recipe).resolve() == Path(cfg.dir).resolve():
        raise RecordingError(f"this run's replay directory {_replay_dir(recipe)} is the recording's own; a recording "
                             "is only read (leave replay.dir unset)")
    return read_recording(cfg)


def use_recording(recipe, console=None):
    """At ``gyre run`` start, once the run directory is ready: for a recipe with ``replay.source``, build this run's
    replay directory from the recording (or re-use the one a previous start built from the same recording) and return
    the recipe the run goes on with (derived replay config, ``learner.num_steps`` at most the steps the recording
    fills); any other recipe is returned as it is. ``console`` (rich) gets one line saying so.

    Raises:
        RecordingError: as ``check_recorded_source``; the replay directory was built from another recording, or
            holds a replay not built from one; or the recording holds fewer groups than one step takes.
    """
    source = recipe.replay.source
    if source is None:
        return recipe
    dest = _replay_dir(recipe)
    manifest = read_manifest(dest)
    if manifest is not None:
        if manifest.get("source_run") != source.recorded:
            raise RecordingError(f"{dest} holds a copy of the recording {manifest.get('source_run')}, not "
                                 f"{source.recorded}; start this run afresh (--resume none)")
        groups, built = len(manifest.get("groups", [])), "re-used"
    else:
        if dest.exists() and any(dest.iterdir()):
            raise RecordingError(f"{dest} holds a replay that was not built from a recording; start this run "
                                 "afresh (--resume none) to train from " + source.recorded)
        recording = check_recorded_source(recipe)
        groups, built = len(recording.groups), "copied"
    per_step, wanted = recipe.learner.groups_per_step, recipe.learner.num_steps
    steps = min(wanted, groups // per_step)
    if steps < 1:
        raise RecordingError(f"the recording {source.recorded} holds {groups} consumed groups, fewer than "
                             f"learner.groups_per_step ({per_step}): not one step's batch")
    if manifest is None:
        write_replay_dir(recording, recorded_replay_config(recipe.replay, groups), dest,
                         {"source_run": source.recorded, "order": ORDER})
    line = (f"training from the recording {source.recorded}: {groups} groups {built} into {dest}, in the order its "
            f"learner consumed them; {steps} steps" + ("" if steps == wanted else
                                                        f" (the recording runs out before num_steps {wanted})"))
    log.info("recording_used", source=source.recorded, groups=groups, built=built, steps=steps, num_steps=wanted)
    if console is not None:
        console.print(line, highlight=False)
    return recipe.model_copy(update={"replay": recorded_replay_config(recipe.replay, groups),
                                     "learner": recipe.learner.model_copy(update={"num_steps": steps})})


def rollouts_to_start(recipe) -> int:
    """Rollout services the controller starts: ``rollout.num_workers``; with ``replay.source`` one for the
    evaluations (``eval.before``, ``eval.after``, ``eval.every_steps``), none if the recipe evaluates nothing."""
    if recipe.replay.source is None:
        return recipe.rollout.num_workers
    ev = recipe.eval
    return 1 if ev.before or ev.after or ev.every_steps else 0
