import dataclasses

import pytest
import torch

from gyre.proto.tensor_chunks import ChunkAssembler, ChunkError, encode_tensors, iter_chunks


def named():
    torch.manual_seed(0)
    return [("a.weight", torch.randn(3, 5).to(torch.bfloat16)), ("b.bias", torch.randn(7)),
            ("c.scalar", torch.tensor(2.5))]


def test_round_trip_in_small_chunks_is_bit_exact():
    chunks = list(iter_chunks(3, encode_tensors(named()), chunk_bytes=4))
    assert len(chunks) > 3 and chunks[-1].last_of_version and chunks[-1].num_tensors == 3
    asm = ChunkAssembler()
    results = [asm.feed(c) for c in chunks]
    assert all(r is None for r in results[:-1])
    version, tensors = results[-1]
    assert version == 3
    for (n1, t1), (n2, t2) in zip(named(), tensors):
        assert n1 == n2 and t1.dtype == t2.dtype and torch.equal(t1, t2)


def test_flipped_byte_fails_checksum_and_names_tensor():
    """Caught on arrival by the chunk's own checksum; from a sender without chunk checksums, by the tensor's."""
    chunks = list(iter_chunks(1, encode_tensors(named()), chunk_bytes=8))
    chunks[1] = dataclasses.replace(chunks[1], data=bytes([chunks[1].data[0] ^ 1]) + chunks[1].data[1:])
    with pytest.raises(ChunkError, match="'a.weight': chunk at offset 8 .8 bytes. fails its checksum"):
        _feed_all(chunks)
    old_sender = [dataclasses.replace(c, chunk_checksum=None) for c in chunks]
    with pytest.raises(ChunkError, match="'a.weight': checksum"):
        _feed_all(old_sender)


def test_missing_chunk_is_an_offset_gap():
    chunks = list(iter_chunks(1, encode_tensors(named()), chunk_bytes=8))
    del chunks[1]
    with pytest.raises(ChunkError, match="offset 16, expected 8"):
        _feed_all(chunks)


def _feed_all(chunks):
    asm = ChunkAssembler()
    for c in chunks:
        asm.feed(c)


def test_unknown_dtype_and_bad_shape_rejected():
    chunks = list(iter_chunks(1, encode_tensors(named()[:1]), chunk_bytes=1 << 20))
    with pytest.raises(ChunkError, match="unknown dtype 'int4'"):
        _feed_all([dataclasses.replace(chunks[0], dtype="int4")])
    with pytest.raises(ChunkError, match=r"shape \[4, 5\]"):
        _feed_all([dataclasses.replace(chunks[0], shape=(4, 5))])


def test_version_switch_mid_stream_rejected():
    chunks = list(iter_chunks(1, encode_tensors(named()), chunk_bytes=8))
    chunks[2] = dataclasses.replace(chunks[2], version=2)
    with pytest.raises(ChunkError, match="version 2 arrived while staging version 1"):
        _feed_all(chunks)
