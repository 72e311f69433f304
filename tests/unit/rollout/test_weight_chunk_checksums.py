"""The chunk stream's checksum: CRC-32C named on every chunk, legacy zlib CRC-32 still verified, anything
else refused by name; and who owns the tensors a version is assembled into."""

import dataclasses
import zlib

import google_crc32c
import pytest
import torch

from gyre.proto import weights_pb2
from gyre.proto.tensor_chunks import (CHUNK_CHECKSUM_KIND, ChunkAssembler, ChunkError, encode_tensors, iter_chunks)
from gyre.services.learner.weight_server import serialize_chunk
from gyre.services.rollout.transport.subscriber import parse_chunk


def named(v: float = 0.0):
    return [("a.weight", (torch.arange(15, dtype=torch.float32).reshape(3, 5) + v).to(torch.bfloat16)),
            ("b.bias", torch.arange(7, dtype=torch.float32) - v), ("c.empty", torch.zeros(0, 4))]


def feed_all(chunks):
    asm, out = ChunkAssembler(), []
    for c in chunks:
        if (got := asm.feed(c)) is not None:
            out.append(got)
    return out


def test_every_chunk_names_crc32c_and_the_last_carries_the_tensors_crc32c():
    tensors = named()
    chunks = list(iter_chunks(4, encode_tensors(tensors), chunk_bytes=8))
    assert CHUNK_CHECKSUM_KIND == "crc32c" and {c.checksum_kind for c in chunks} == {"crc32c"}
    lasts = [c for c in chunks if c.last_of_tensor]
    want = [google_crc32c.value(t.reshape(-1).view(torch.uint8).numpy().tobytes()) for _, t in tensors]
    assert [c.checksum for c in lasts] == want and want[0] != zlib.crc32(tensors[0][1].view(torch.uint8).numpy())
    assert all(c.checksum == 0 for c in chunks if not c.last_of_tensor)


def test_checksum_kind_survives_the_wire_and_an_old_senders_chunk_reads_as_empty():
    c = next(iter_chunks(1, encode_tensors(named()[:1]), chunk_bytes=1 << 20))
    assert parse_chunk(serialize_chunk(c)) == dataclasses.replace(c, data=parse_chunk(serialize_chunk(c)).data)
    old = weights_pb2.WeightChunk(version=1, name="w", dtype="float32", shape=[1], nbytes=4, data=b"\0" * 4,
                                  last_of_tensor=True, checksum=zlib.crc32(b"\0" * 4), last_of_version=True,
                                  num_tensors=1)  # field 13 never set, as senders before it wrote
    [(version, [(name, t)])] = feed_all([parse_chunk(old.SerializeToString())])
    assert parse_chunk(old.SerializeToString()).checksum_kind == ""
    assert (version, name, t.tolist()) == (1, "w", [0.0])


@pytest.mark.parametrize("kind", ["crc32", ""])
def test_legacy_zlib_crc32_chunks_are_still_verified(kind):
    chunks = [dataclasses.replace(c, checksum_kind=kind, chunk_checksum=None,  # a sender from before both
                                  checksum=zlib.crc32(t.reshape(-1).view(torch.uint8).numpy().tobytes())
                                  if c.last_of_tensor else 0)
              for c, (_, t) in _with_tensor(named(), chunk_bytes=8)]
    [(_, got)] = feed_all(chunks)
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, named()))
    chunks[3] = dataclasses.replace(chunks[3], data=bytes([chunks[3].data[0] ^ 4]) + bytes(chunks[3].data[1:]))
    with pytest.raises(ChunkError, match=r"'a.weight': checksum 0x[0-9a-f]{8} != sent 0x[0-9a-f]{8} \(crc32\)"):
        feed_all(chunks)


def _with_tensor(tensors, chunk_bytes):
    chunks = list(iter_chunks(1, encode_tensors(tensors), chunk_bytes=chunk_bytes))
    by_name = dict(tensors)
    return [(c, (c.name, by_name[c.name])) for c in chunks]


def test_an_unknown_checksum_kind_is_refused_by_name_before_staging():
    chunks = list(iter_chunks(1, encode_tensors(named()), chunk_bytes=8))
    bad = [dataclasses.replace(c, checksum_kind="xxh64") if c.name == "b.bias" else c for c in chunks]
    with pytest.raises(ChunkError, match=r"'b.bias': unknown checksum kind 'xxh64'; expected one of "
                                         r"\['', 'crc32', 'crc32c'\]"):
        feed_all(bad)


def test_a_checksum_kind_that_changes_mid_tensor_is_refused():
    chunks = list(iter_chunks(1, encode_tensors(named()), chunk_bytes=8))
    chunks[2] = dataclasses.replace(chunks[2], checksum_kind="crc32")  # a.weight's third chunk
    with pytest.raises(ChunkError, match="'a.weight': chunk at offset 16 says .* checksum 'crc32', .*; its first "
                                         "chunk said .* checksum 'crc32c', "):
        feed_all(chunks)


def test_a_flipped_byte_under_crc32c_names_the_tensor_and_both_values():
    """The tensor's CRC-32C, as a sender without per-chunk checksums has it checked (``test_tensor_chunks`` has
    the per-chunk check)."""
    chunks = [dataclasses.replace(c, chunk_checksum=None)
              for c in iter_chunks(1, encode_tensors(named()), chunk_bytes=8)]
    i = next(j for j, c in enumerate(chunks) if c.name == "b.bias")
    chunks[i] = dataclasses.replace(chunks[i], data=bytes([chunks[i].data[0] ^ 1]) + bytes(chunks[i].data[1:]))
    sent = next(c.checksum for c in chunks if c.name == "b.bias" and c.last_of_tensor)
    with pytest.raises(ChunkError, match=rf"'b.bias': checksum 0x[0-9a-f]{{8}} != sent {sent:#010x} \(crc32c\)"):
        feed_all(chunks)


def test_a_version_owns_its_tensors_the_next_version_never_writes_them():
    """Ownership: each version's tensors are private memory handed to the caller; staging the next
    version (same names, shapes and sizes) allocates anew instead of reusing them."""
    asm = ChunkAssembler()
    first = [r for r in map(asm.feed, iter_chunks(1, encode_tensors(named(1.0)), chunk_bytes=8)) if r]
    second = [r for r in map(asm.feed, iter_chunks(2, encode_tensors(named(2.0)), chunk_bytes=8)) if r]
    assert [v for v, _ in first + second] == [1, 2]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(first[0][1], named(1.0)))
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(second[0][1], named(2.0)))
    assert first[0][1][0][1].data_ptr() != second[0][1][0][1].data_ptr()
    assert [tuple(t.shape) for _, t in first[0][1]] == [(3, 5), (7,), (0, 4)]
