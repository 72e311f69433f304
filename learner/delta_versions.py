"""A published version as sparse deltas against a base version a subscriber holds (``proto.sparse_delta``).

``relative_version`` turns the newest version's encoded tensors into what travels to a subscriber holding ``base``:
each tensor as a delta when that is smaller, else whole. The weight server computes it once per (base, version)
pair in a worker thread and shares it between every subscriber on that base.
"""

from __future__ import annotations

from dataclasses import dataclass

from gyre.proto import sparse_delta
from gyre.proto.tensor_chunks import DTYPES, EncodedTensor


@dataclass(frozen=True)
class DeltaVersion:
    """What travels for one (base, version) pair, and how sparse it was."""

    tensors: list[EncodedTensor]
    """Per tensor: a delta (``encoding`` set) or the tensor whole."""
    delta_bytes: int
    """Bytes of ``tensors``' data (what a subscriber receives, headers aside)."""
    full_bytes: int
    """Bytes of the version sent whole."""
    changed_fraction: float
    """Elements that differ from the base ÷ all elements (tensors sent whole count as all changed)."""


def relative_version(base: list[EncodedTensor], new: list[EncodedTensor]) -> DeltaVersion | None:
    """``new`` relative to ``base`` (the same names, dtypes and shapes; a tensor that differs in any of them is sent
    whole), or ``None`` when the deltas would not save bytes (send the version whole)."""
    by_name = {t.name: t for t in base}
    out, sent, full, changed, elements = [], 0, 0, 0, 0
    for t in new:
        itemsize = DTYPES[t.dtype].itemsize
        numel = len(t.data) // itemsize
        b = by_name.get(t.name)
        delta = (sparse_delta.encode_delta(b.data, t.data, itemsize)
                 if b is not None and (b.dtype, b.shape) == (t.dtype, t.shape) else None)
        if delta is None:
            out.append(t)
            changed += numel
        else:
            out.append(EncodedTensor(t.name, t.dtype, t.shape, memoryview(delta), t.checksum,
                                     encoding=sparse_delta.ENCODING))
            changed += sparse_delta.changed_count(delta)
        sent += len(out[-1].data)
        full += len(t.data)
        elements += numel
    if sent >= full:
        return None
    return DeltaVersion(out, sent, full, changed / max(elements, 1))
