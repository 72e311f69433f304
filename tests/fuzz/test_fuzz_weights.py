"""Fuzz the weight transfer: ``ChunkAssembler`` fed damaged chunk streams, and the WeightService RPCs
with random requests against a real server on port 0.

A damaged stream must raise ``ChunkError`` (never another exception) and never yield a version; the
assembler then stages the next stream from scratch. Versions going backwards are the subscriber's
business: the assembler hands back whatever whole version it got, ``WeightSubscriber`` ignores one
that is not newer.
"""

from __future__ import annotations

import dataclasses

import grpc
import pytest
import torch
from google.protobuf.message import DecodeError
from hypothesis import assume, given, strategies as st

from gyre.learner.publisher import WeightPublisher
from gyre.proto import weights_pb2, weights_pb2_grpc
from gyre.proto.tensor_chunks import (CHUNK_CHECKSUMS, DTYPES, ChunkAssembler, ChunkError, TensorChunk, encode_tensors,
                                 iter_chunks)
from gyre.services.common import grpc_common
from gyre.services.learner import weight_server
from gyre.services.rollout.transport.subscriber import parse_chunk

def chunk_of(msg: weights_pb2.WeightChunk) -> TensorChunk:
    """The ``TensorChunk`` a parsed ``WeightChunk`` message stands for (field by field)."""
    return TensorChunk(version=msg.version, name=msg.name, dtype=msg.dtype, shape=tuple(msg.shape),
                       offset=msg.offset, data=msg.data, nbytes=msg.nbytes, last_of_tensor=msg.last_of_tensor,
                       checksum=msg.checksum, last_of_version=msg.last_of_version, num_tensors=msg.num_tensors,
                       checksum_kind=msg.checksum_kind)


SHAPES = st.lists(st.integers(1, 5), min_size=0, max_size=3).map(tuple)


@st.composite
def versions(draw) -> tuple[list[tuple[str, torch.Tensor]], list[TensorChunk]]:
    """A policy version of 1-3 random tensors (``DTYPES``, shapes up to [5, 5, 5]) cut into random chunks."""
    named = []
    for i in range(draw(st.integers(1, 3))):
        shape, dtype = draw(SHAPES), DTYPES[draw(st.sampled_from(sorted(DTYPES)))]
        gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
        named.append((f"layer{i}.weight", torch.randn(shape, generator=gen).to(dtype)))
    chunks = list(iter_chunks(draw(st.integers(0, 2**40)), encode_tensors(named), draw(st.integers(1, 64))))
    return named, chunks


def feed_all(chunks: list[TensorChunk]):
    asm, out = ChunkAssembler(), []
    for c in chunks:
        if (got := asm.feed(c)) is not None:
            out.append(got)
    return asm, out


@given(version=versions())
def test_an_undamaged_stream_is_bit_exact(version):
    """The control: the damaged cases below start from streams that assemble."""
    named, chunks = version
    _, [(v, tensors)] = feed_all(chunks)
    assert v == chunks[0].version and [n for n, _ in tensors] == [n for n, _ in named]
    assert all(t.dtype == w.dtype and torch.equal(t.reshape(-1).view(torch.uint8), w.reshape(-1).view(torch.uint8))
               for (_, t), (_, w) in zip(tensors, named))


def _damage(data, chunks: list[TensorChunk]) -> tuple[list[TensorChunk], str]:
    """One damage of the stream, and a text the ``ChunkError`` must contain."""
    kinds = ["crc", "checksum_kind", "offset", "nbytes", "dtype_name", "shape", "num_tensors", "truncate"]
    kind = data.draw(st.sampled_from(kinds + (["drop", "repeat", "version"] if len(chunks) > 1 else [])))
    i = data.draw(st.integers(0, len(chunks) - 1))
    c, out = chunks[i], list(chunks)
    if kind == "crc":
        i = data.draw(st.sampled_from([j for j, x in enumerate(chunks) if x.last_of_tensor]))
        out[i] = dataclasses.replace(chunks[i], checksum=chunks[i].checksum ^ data.draw(st.integers(1, 2**32 - 1)))
        return out, "checksum"
    if kind == "checksum_kind":
        name = data.draw(st.text(max_size=10).filter(lambda s: s not in CHUNK_CHECKSUMS))
        out[i] = dataclasses.replace(c, checksum_kind=name)
        return out, f"checksum {name!r}" if c.offset else f"unknown checksum kind {name!r}"
    if kind == "offset":
        delta = data.draw(st.integers(-c.offset, 2**40).filter(lambda d: d != 0))
        out[i] = dataclasses.replace(c, offset=c.offset + delta)
        return out, f"chunk at offset {c.offset + delta}"
    if kind in ("drop", "repeat"):
        # Not the version's last chunk: a stream that just stops is no error (the subscriber's watchdog
        # ends it), and a whole version followed by a stray chunk is a whole version.
        i = data.draw(st.integers(0, len(chunks) - 2))
        out.insert(i, chunks[i]) if kind == "repeat" else out.pop(i)
        return out, ""  # offset gap, a tensor that ends early, or a short count: any named ChunkError
    if kind == "nbytes":
        i = data.draw(st.sampled_from([j for j, x in enumerate(chunks) if x.last_of_tensor]))
        huge = data.draw(st.integers(0, 2**64 - 1).filter(lambda n: n != chunks[i].nbytes))
        out[i] = dataclasses.replace(chunks[i], nbytes=huge)
        return out, f"{huge}"  # "N bytes received, {huge} expected" or "shape [...] × dtype != {huge} bytes"
    if kind == "dtype_name":
        name = data.draw(st.text(max_size=10).filter(lambda s: s not in DTYPES))
        out[i] = dataclasses.replace(c, dtype=name)  # a later chunk of a tensor disagrees with its first
        return out, f"says dtype {name}, shape" if c.offset else f"unknown dtype {name!r}"
    if kind == "version":
        i = data.draw(st.integers(1, len(chunks) - 1))
        other = data.draw(st.integers(-(2**63), 2**63 - 1).filter(lambda v: v != chunks[i].version))
        out[i:] = [dataclasses.replace(x, version=other) for x in chunks[i:]]
        return out, f"version {other} arrived while staging version {chunks[i].version}"
    if kind == "shape":
        i = data.draw(st.sampled_from([j for j, x in enumerate(chunks) if x.last_of_tensor]))
        shape = data.draw(st.lists(st.integers(0, 7), max_size=4).map(tuple))
        assume(torch.Size(shape).numel() * DTYPES[chunks[i].dtype].itemsize != chunks[i].nbytes)
        out[i] = dataclasses.replace(chunks[i], shape=shape)
        return out, f"shape {list(shape)}"
    if kind == "num_tensors":
        n = data.draw(st.integers(0, 2**32 - 1).filter(lambda n: n != chunks[-1].num_tensors))
        out[-1] = dataclasses.replace(chunks[-1], num_tensors=n)
        return out, f"{n} sent"
    data_chunks = [j for j, x in enumerate(chunks) if x.data]
    i = data.draw(st.sampled_from(data_chunks)) if data_chunks else i
    cut = data.draw(st.integers(0, max(len(chunks[i].data) - 1, 0)))
    out[i] = dataclasses.replace(chunks[i], data=chunks[i].data[:cut])
    return out, ""


@given(version=versions().filter(lambda v: any(c.data for c in v[1])), data=st.data())
def test_a_damaged_stream_is_a_named_chunk_error_and_never_a_version(version, data):
    named, chunks = version
    damaged, names = _damage(data, chunks)
    asm = ChunkAssembler()
    with pytest.raises(ChunkError) as err:
        for c in damaged:
            assert asm.feed(c) is None, "a damaged stream produced a version"
    assert names in str(err.value)
    [(v, tensors)] = [r for r in map(asm.feed, chunks) if r is not None]  # the resent stream assembles
    assert v == chunks[0].version and len(tensors) == len(named)


@given(first=versions(), second=versions())
def test_versions_going_backwards_assemble_and_the_subscriber_rule_drops_them(first, second):
    """The assembler is version-agnostic between versions; ``WeightSubscriber`` applies ``version >
    have_version`` (tested against a real server in tests/integration)."""
    chunks_new = [dataclasses.replace(c, version=10) for c in first[1]]
    chunks_old = [dataclasses.replace(c, version=3) for c in second[1]]
    _, got = feed_all(chunks_new + chunks_old)
    assert [v for v, _ in got] == [10, 3]


# ---- malformed chunk metadata (once bugs, now refused) -----------------------------------------------------------------------------------
def _one_tensor() -> list[TensorChunk]:
    named = [("w", torch.arange(32, dtype=torch.float32).reshape(4, 8).to(torch.float16))]
    return list(iter_chunks(1, encode_tensors(named), chunk_bytes=16))


@pytest.mark.parametrize("damage, names", [
    pytest.param(lambda cs: cs[:-1] + [dataclasses.replace(cs[-1], shape=(-4, -8))], "shape [-4, -8]",
                 id="negative-dims"),
    pytest.param(lambda cs: cs[:-1] + [dataclasses.replace(cs[-1], dtype="bfloat16")], "dtype",
                 id="dtype-changes-mid-tensor"),
    pytest.param(lambda cs: [dataclasses.replace(cs[0], shape=(32,))] + cs[1:], "shape",
                 id="shape-changes-mid-tensor"),
])
def test_known_bad_chunk_metadata_is_a_chunk_error(damage, names):
    with pytest.raises(ChunkError, match=names.replace("[", r"\[")):
        feed_all(damage(_one_tensor()))


# ---- WeightChunk wire parsing (the subscriber's zero-copy deserializer) ------------------------------
def _wire(chunk: TensorChunk) -> bytes:
    return weights_pb2.WeightChunk(
        version=chunk.version, name=chunk.name, dtype=chunk.dtype, shape=chunk.shape, offset=chunk.offset,
        data=bytes(chunk.data), nbytes=chunk.nbytes, last_of_tensor=chunk.last_of_tensor, checksum=chunk.checksum,
        last_of_version=chunk.last_of_version, num_tensors=chunk.num_tensors, schema_version=2,
        checksum_kind=chunk.checksum_kind).SerializeToString()


@st.composite
def wire_bytes(draw) -> bytes:
    """Random bytes, or a real ``WeightChunk``'s bytes with 1-3 bytes changed, cut, or extended."""
    if draw(st.booleans()):
        return draw(st.binary(max_size=200))
    raw = bytearray(_wire(draw(st.sampled_from(draw(versions())[1]))))
    for _ in range(draw(st.integers(1, 3))):
        action = draw(st.sampled_from(["set", "cut", "append"]))
        if action == "set" and raw:
            raw[draw(st.integers(0, len(raw) - 1))] = draw(st.integers(0, 255))
        elif action == "cut":
            del raw[draw(st.integers(0, len(raw))):]
        else:
            raw += draw(st.binary(min_size=1, max_size=8))
    return bytes(raw)


@given(raw=wire_bytes())
def test_parse_chunk_agrees_with_protobuf(raw):
    """Differential: where protobuf decodes the bytes, ``parse_chunk`` gives the same chunk (data
    included); where it does not, ``parse_chunk`` refuses them too (which exception: see below)."""
    try:
        want = chunk_of(weights_pb2.WeightChunk.FromString(raw))
    except DecodeError:
        with pytest.raises((ChunkError, DecodeError)):
            parse_chunk(raw)
        return
    got = parse_chunk(raw)
    assert dataclasses.replace(got, data=bytes(got.data)) == dataclasses.replace(want, data=bytes(want.data))


@pytest.mark.parametrize("raw", [
    pytest.param(b"\x12\x01\xff", id="name-not-utf8"),
    pytest.param(b"\x02\rlayer0.weight\x1a\x08bfloat162\x01\xc58\x02`\x02", id="corrupt-wire-format"),
])
def test_parse_chunk_refuses_with_chunk_error(raw):
    with pytest.raises(ChunkError, match="malformed WeightChunk"):
        parse_chunk(raw)


# ---- WeightService RPCs -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def weights():
    publisher = WeightPublisher()
    publisher.publish(3, [("w", torch.arange(6, dtype=torch.float32).reshape(2, 3))])
    server, port = weight_server.serve(publisher)
    channel = grpc_common.channel(f"127.0.0.1:{port}")
    yield weights_pb2_grpc.WeightServiceStub(channel), channel, f"127.0.0.1:{port}"
    publisher.close()
    channel.close()
    server.stop(0)


@given(have=st.integers(-(2**63), 2**63 - 1), subscriber=st.text(max_size=30))
def test_subscribe_with_any_have_version(weights, have, subscriber):
    stub, _, address = weights
    # Nothing newer than have >= 3 exists: the stream waits, and its deadline ends it.
    stream = stub.Subscribe(weights_pb2.SubscribeRequest(have_version=have, subscriber=subscriber),
                            timeout=0.3 if have >= 3 else 20)
    asm, got = ChunkAssembler(), None
    try:
        for msg in stream:
            if (got := asm.feed(chunk_of(msg))) is not None:
                break
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and have >= 3, exc
    finally:
        stream.cancel()
    if have < 3:
        assert got is not None and got[0] == 3 and torch.equal(got[1][0][1], torch.arange(6.0).reshape(2, 3))
    assert stub.Latest(weights_pb2.LatestRequest(), timeout=5).version == 3
    assert grpc_common.check_health(address, weight_server.SERVICE_NAME)


@given(garbage=st.binary(min_size=1, max_size=64))
def test_latest_with_undecodable_bytes_leaves_the_server_up(weights, garbage):
    stub, channel, address = weights
    try:
        resp = channel.unary_unary("/gyre.weights.v1.WeightService/Latest")(garbage, timeout=5)
        assert weights_pb2.LatestResponse.FromString(resp).version == 3
    except grpc.RpcError as exc:
        # the threaded server said INTERNAL "deserializing request"; grpc.aio (the weight server's) says UNKNOWN
        assert ((exc.code(), "deserializing request" in exc.details()) == (grpc.StatusCode.INTERNAL, True)
                or (exc.code(), "Error parsing message" in exc.details()) == (grpc.StatusCode.UNKNOWN, True)), exc
    assert stub.Latest(weights_pb2.LatestRequest(), timeout=5).version == 3
