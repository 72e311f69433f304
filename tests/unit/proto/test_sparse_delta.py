"""Sparse delta encoding (``proto.sparse_delta``) and its use by the chunk assembler: bit-exact round trips, a delta
only when it is smaller, and a delta that does not match the receiver's base refused by the tensor's CRC-32C."""

import dataclasses

import pytest
import torch

from gyre.learner.delta_versions import relative_version
from gyre.proto import sparse_delta
from gyre.proto.tensor_chunks import ChunkAssembler, ChunkError, encode_tensors, iter_chunks


def _bytes(t: torch.Tensor) -> bytes:
    return t.reshape(-1).view(torch.uint8).numpy().tobytes()


def _pair(n=10_000, changed=0.03, seed=0):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(n, generator=gen).to(torch.bfloat16)
    b = a.clone()
    idx = torch.randperm(n, generator=gen)[:int(n * changed)]
    b[idx] = torch.randn(idx.numel(), generator=gen).to(torch.bfloat16)
    return a, b


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_a_delta_rebuilds_the_new_tensor_bit_for_bit(dtype):
    a, b = _pair()
    a, b = a.to(dtype), b.to(dtype)
    a[0], b[-1] = -0.0, float("nan")  # signed zeros and NaNs compare as bits
    itemsize = a.element_size()
    delta = sparse_delta.encode_delta(_bytes(a), _bytes(b), itemsize)
    assert delta is not None and len(delta) < 0.2 * len(_bytes(b))
    assert sparse_delta.apply_delta(_bytes(a), delta, itemsize) == _bytes(b)
    assert sparse_delta.changed_count(delta) == round(sparse_delta.density(_bytes(a), _bytes(b), itemsize) * a.numel())


def test_no_delta_when_it_would_not_be_smaller_and_an_unchanged_tensor_is_a_few_bytes():
    a, b = _pair(changed=1.0)
    assert sparse_delta.encode_delta(_bytes(a), _bytes(b), 2) is None
    same = sparse_delta.encode_delta(_bytes(a), _bytes(a), 2)
    assert len(same) < 64 and sparse_delta.apply_delta(_bytes(a), same, 2) == _bytes(a)


def test_a_broken_delta_is_refused_by_name():
    a, b = _pair()
    delta = sparse_delta.encode_delta(_bytes(a), _bytes(b), 2)
    with pytest.raises(sparse_delta.DeltaError, match="header says"):
        sparse_delta.apply_delta(_bytes(a), delta[:-2], 2)
    with pytest.raises(sparse_delta.DeltaError, match="shorter than its 8-byte header"):
        sparse_delta.apply_delta(_bytes(a), b"\0", 2)
    with pytest.raises(sparse_delta.DeltaError, match="changes element"):
        sparse_delta.apply_delta(_bytes(a)[:100], delta, 2)  # a base shorter than the delta's positions
    with pytest.raises(sparse_delta.DeltaError, match="base has"):
        sparse_delta.encode_delta(b"ab", b"abcd", 2)


def _version(changed):
    a, b = _pair(changed=changed)
    return [("w", a), ("v", torch.ones(4))], [("w", b), ("v", torch.ones(4))]


def _feed(chunks, base):
    asm = ChunkAssembler(base=base)
    out = None
    for c in chunks:
        out = asm.feed(c) or out
    return out, asm


def test_the_assembler_rebuilds_a_delta_version_from_its_base_and_checks_it_whole():
    old, new = _version(0.03)
    base_enc, new_enc = encode_tensors(old), encode_tensors(new)
    rel = relative_version(base_enc, new_enc)
    assert rel is not None and rel.delta_bytes < 0.2 * rel.full_bytes and 0.02 < rel.changed_fraction < 0.04
    assert [t.encoding for t in rel.tensors] == [sparse_delta.ENCODING, ""]  # 16 bytes: a delta is no smaller
    chunks = list(iter_chunks(2, rel.tensors, chunk_bytes=512, timeline=7, base=(1, 7)))
    _, first = _feed(iter_chunks(1, base_enc, chunk_bytes=512, timeline=7), None)
    (version, got), asm = _feed(chunks, (1, 7, first.raw))
    assert version == 2 and all(torch.equal(g, n) for (_, g), (_, n) in zip(got, new))
    assert asm.raw["w"] == _bytes(new[0][1])  # the base of the next delta


def test_a_delta_against_another_base_is_refused_never_applied():
    """The receiver holds other weights under the base's name: the rebuilt tensor fails the full CRC-32C."""
    old, new = _version(0.03)
    rel = relative_version(encode_tensors(old), encode_tensors(new))
    chunks = list(iter_chunks(2, rel.tensors, chunk_bytes=512, timeline=7, base=(1, 7)))
    wrong = {"w": _bytes(old[0][1] + 1), "v": _bytes(old[1][1])}
    with pytest.raises(ChunkError, match="'w': checksum"):
        _feed(chunks, (1, 7, wrong))
    with pytest.raises(ChunkError, match=r"'w': a delta against version \(1, 7\), but this subscriber holds \(0, 7\)"):
        _feed(chunks, (0, 7, wrong))
    with pytest.raises(ChunkError, match="holds no base"):
        _feed(chunks, None)
    unknown = [dataclasses.replace(c, encoding="zip") for c in chunks]
    with pytest.raises(ChunkError, match="unknown encoding 'zip'"):
        _feed(unknown, (1, 7, wrong))
