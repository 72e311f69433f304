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
  re-publishes versions bit-identical to the lost ones (exact resume), so nothing downstream can tell. That
  needs deterministic kernels: the learner process calls ``deterministic_kernels`` before CUDA starts. And it
  is checked, not trusted: on resume the learner sets every stored version above its own aside
  (``VersionStore.set_aside_after``: rollouts cannot load them) and re-writing one compares the new tensors'
  sha256 with the set-aside file's; a mismatch is ``VersionMismatchError`` (exact resume broken).

Needs a filesystem every service sees (one node, or NFS/Lustre across nodes).
"""

from __future__ import annotations

import hashlib
import os
import re
import zlib
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field
from safetensors.torch import load_file, save_file

from gyre.utils.durable import fsync_path

_VERSION_FILE = re.compile(r"^v(\d+)\.safetensors$")
_ASIDE_FILE = re.compile(r"^v(\d+)\.safetensors\.unverified$")
CUBLAS_WORKSPACE_CONFIG = ":4096:8"
"""cuBLAS workspace setting that makes its GEMMs deterministic (CUDA docs, "Results reproducibility")."""


def deterministic_kernels() -> None:
    """Make this process's torch kernels deterministic: ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (read when cuBLAS
    starts, so call this before the first CUDA operation) and ``torch.use_deterministic_algorithms(True)``
    (an op without a deterministic kernel then raises ``RuntimeError`` instead of drifting). Harmless on CPU.

    Raises:
        RuntimeError: ``CUBLAS_WORKSPACE_CONFIG`` is already set to another value (named).
    """
    have = os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE_CONFIG)
    if have not in (CUBLAS_WORKSPACE_CONFIG, ":16:8"):  # the two settings CUDA documents as deterministic
        raise RuntimeError(f"CUBLAS_WORKSPACE_CONFIG is {have!r}; lockstep needs {CUBLAS_WORKSPACE_CONFIG!r} "
                           "(or ':16:8') for deterministic cuBLAS")
    torch.use_deterministic_algorithms(True)


def weights_sha256(named: list[tuple[str, torch.Tensor]]) -> str:
    """sha256 hex over a version's tensors sorted by name: each name, dtype, shape and raw bytes (CPU copy).
    Equal for the same tensors whatever their order or device."""
    h = hashlib.sha256()
    for name, t in sorted(named, key=lambda nt: nt[0]):
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class VersionMismatchError(RuntimeError):
    """A re-written policy version differs from the one a crashed learner wrote: exact resume is broken."""


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
    renamed), keeping the ``keep`` versions up to the one written last (lockstep needs ``lag + 2``).

    A version written again (a learner resumed from an older checkpoint) must be bit-identical to the stored
    one, or to the one ``set_aside_after`` moved aside: ``write`` compares their ``weights_sha256`` and
    raises ``VersionMismatchError`` on a difference, leaving the stored file as it was (an equal one is
    replaced atomically; readers see the old or the new file, never a torn one)."""

    def __init__(self, root: str | Path, keep: int = 4) -> None:
        if keep < 1:
            raise ValueError(f"keep ({keep}) must be >= 1")
        self.root, self.keep = Path(root), keep
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, version: int) -> Path:
        return self.root / f"v{version}.safetensors"

    def aside_path(self, version: int) -> Path:
        """Where ``set_aside_after`` keeps an unverified ``version`` (a name ``versions``/``read`` ignore)."""
        return self.root / f"v{version}.safetensors.unverified"

    def set_aside_after(self, version: int) -> list[int]:
        """Move every stored version above ``version`` aside (a resumed learner's predecessor wrote them):
        rollouts wait for them until the learner writes each again and ``write`` has checked it. Returns the
        versions moved, ascending."""
        moved = [v for v in self.versions() if v > version]
        for v in moved:
            os.replace(self.path(v), self.aside_path(v))
        if moved:
            fsync_path(self.root)
        return moved

    def _check_rewrite(self, version: int, tensors: dict[str, torch.Tensor]) -> Path | None:
        """Raise ``VersionMismatchError`` if ``version`` is stored (or set aside) with other tensors; returns
        the set-aside file to delete after the write, if any."""
        aside = self.aside_path(version)
        for old in (self.path(version), aside):
            try:
                stored = load_file(str(old))
            except FileNotFoundError:
                continue
            want, got = weights_sha256(list(stored.items())), weights_sha256(list(tensors.items()))
            if want != got:
                raise VersionMismatchError(
                    f"policy version {version} re-written with other weights (sha256 {got[:16]}…) than the "
                    f"stored {old.name} (sha256 {want[:16]}…): the resumed learner is not reproducing the lost "
                    "versions exactly (lockstep's exact resume is broken; check deterministic kernels, the "
                    "checkpoint and the data order)")
        return aside if aside.exists() else None

    def versions(self) -> list[int]:
        """Stored versions, ascending."""
        return sorted(int(m.group(1)) for p in self.root.iterdir() if (m := _VERSION_FILE.match(p.name)))

    def write(self, version: int, named: list[tuple[str, torch.Tensor]]) -> Path:
        """Store ``version`` ([name, tensor] pairs, any float dtype, kept as is) and prune old versions.

        Raises:
            ValueError: ``version < 0`` or a name appears twice.
            VersionMismatchError: ``version`` is stored or set aside with other tensors (nothing written).
        """
        if version < 0:
            raise ValueError(f"version ({version}) must be >= 0")
        tensors: dict[str, torch.Tensor] = {}
        for name, t in named:
            if name in tensors:
                raise ValueError(f"tensor {name!r} appears twice in version {version}")
            tensors[name] = t.detach().to("cpu").contiguous().clone()
        aside = self._check_rewrite(version, tensors)
        final = self.path(version)
        tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
        save_file(tensors, str(tmp), metadata={"policy_version": str(version)})
        fsync_path(tmp)
        os.replace(tmp, final)
        if aside is not None:
            aside.unlink(missing_ok=True)
        fsync_path(self.root)
        for old in self.versions():  # relative to this version: a resumed learner re-writes older ones
            if old <= version - self.keep:
                self.path(old).unlink(missing_ok=True)
        for p in self.root.iterdir():  # set-aside versions pruned alike
            if (m := _ASIDE_FILE.match(p.name)) and int(m.group(1)) <= version - self.keep:
                p.unlink(missing_ok=True)
        return final

    def read(self, version: int) -> list[tuple[str, torch.Tensor]] | None:
        """The tensors of ``version`` sorted by name, or ``None`` if it is not stored (not yet, or pruned)."""
        try:
            tensors = load_file(str(self.path(version)))
        except FileNotFoundError:
            return None
        return sorted(tensors.items())
