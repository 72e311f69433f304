"""Deterministic mode (``determinism: lockstep``): the contract between rollouts, replay and the learner.

In lockstep a run is a pure function of its recipe and seed, however often its services crash:

- **Schedule.** Learner step ``s`` trains exactly the groups of prompts ``[s·P, (s+1)·P)`` (``P`` =
  ``groups_per_step``), leased from replay by prompt index in that order (canonical consumption order).
  Prompt ``i`` is generated with exactly policy version ``v(i) = max(0, i // P - lag)``: a fixed policy lag
  ``lag`` (``lag = 0`` is synchronous on-policy RL; ``lag = 1`` overlaps generating step ``s + 1`` with
  training step ``s``, as in one-step off-policy pipelines such as AReaL's bounded staleness with η = 1).
- **Seeds.** Sample ``j`` of prompt ``i`` uses sampling seed ``crc32(f"{seed}-{i}") + j`` whichever rollout,
  attempt or restart generates it, so a regenerated group is token-for-token the one that was lost.
- **Exact versions.** The learner writes every policy version it publishes to ``VersionStore`` (one
  safetensors file per version, atomically); a rollout loads the exact version a prompt needs from it, older
  than its current one if a re-issued prompt asks for that. A learner resumed from an older checkpoint
  re-publishes versions bit-identical to the lost ones (exact resume), so nothing downstream can tell.

Needs a filesystem every service sees (one node, or NFS/Lustre across nodes).
"""

from __future__ import annotations

import os
import re
import zlib
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field
from safetensors.torch import load_file, save_file

from proto.durable import fsync_path

_VERSION_FILE = re.compile(r"^v(\d+)\.safetensors$")


class LockstepConfig(BaseModel):
    """Lockstep settings a recipe hands to the rollouts and the learner (``Recipe.determinism``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    lag: int = Field(1, ge=0)
    """Fixed policy lag k: prompts of step s are generated with policy version ``max(0, s - k)``."""
    groups_per_step: int = Field(ge=1)
    """P: groups (prompts) per learner step (``learner.groups_per_step``)."""
    seed: int = 0
    """Base of every sampling seed (the recipe's ``seed``; the same for every rollout)."""
    weights_dir: str
    """``VersionStore`` folder: ``{run_dir}/{name}/weights``."""

    def step_of(self, prompt_index: int) -> int:
        """Learner step that trains prompt ``prompt_index``."""
        return prompt_index // self.groups_per_step

    def version_for(self, prompt_index: int) -> int:
        """Policy version prompt ``prompt_index`` must be generated with: ``max(0, i // P - lag)``."""
        return max(0, self.step_of(prompt_index) - self.lag)

    def prompts_of_step(self, step: int) -> list[int]:
        """Prompt indices learner step ``step`` trains, in consumption order."""
        return list(range(step * self.groups_per_step, (step + 1) * self.groups_per_step))

    def seed_for(self, prompt_index: int) -> int:
        """Sampling seed of prompt ``prompt_index`` (sample j adds j): independent of rollout and attempt."""
        return zlib.crc32(f"{self.seed}-{prompt_index}".encode())


class VersionStore:
    """Every published policy version as ``{root}/v{version}.safetensors`` (written to a temp name, fsync'd,
    renamed), keeping the ``keep`` versions up to the one written last (lockstep needs ``lag + 2``). Re-writing a version (a learner resumed from an older
    checkpoint) replaces the file atomically; readers see the old or the new file, never a torn one."""

    def __init__(self, root: str | Path, keep: int = 4) -> None:
        if keep < 1:
            raise ValueError(f"keep ({keep}) must be >= 1")
        self.root, self.keep = Path(root), keep
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, version: int) -> Path:
        return self.root / f"v{version}.safetensors"

    def versions(self) -> list[int]:
        """Stored versions, ascending."""
        return sorted(int(m.group(1)) for p in self.root.iterdir() if (m := _VERSION_FILE.match(p.name)))

    def write(self, version: int, named: list[tuple[str, torch.Tensor]]) -> Path:
        """Store ``version`` ([name, tensor] pairs, any float dtype, kept as is) and prune old versions.

        Raises:
            ValueError: ``version < 0`` or a name appears twice.
        """
        if version < 0:
            raise ValueError(f"version ({version}) must be >= 0")
        tensors: dict[str, torch.Tensor] = {}
        for name, t in named:
            if name in tensors:
                raise ValueError(f"tensor {name!r} appears twice in version {version}")
            tensors[name] = t.detach().to("cpu").contiguous().clone()
        final = self.path(version)
        tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
        save_file(tensors, str(tmp), metadata={"policy_version": str(version)})
        fsync_path(tmp)
        os.replace(tmp, final)
        fsync_path(self.root)
        for old in self.versions():  # relative to this version: a resumed learner re-writes older ones
            if old <= version - self.keep:
                self.path(old).unlink(missing_ok=True)
        return final

    def read(self, version: int) -> list[tuple[str, torch.Tensor]] | None:
        """The tensors of ``version`` sorted by name, or ``None`` if it is not stored (not yet, or pruned)."""
        try:
            tensors = load_file(str(self.path(version)))
        except FileNotFoundError:
            return None
        return sorted(tensors.items())
