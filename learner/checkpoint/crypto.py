"""At-rest encryption of archived checkpoint files: AES-256-GCM (NIST SP 800-38D) via ``cryptography``.

Each file is encrypted on its own, streamed in fixed-size chunks, so a multi-GiB optimizer shard never
sits in memory whole. Object format (all integers big-endian)::

    header   = b"GYREAE1\\0" (8 bytes, magic + format version) ‖ chunk_bytes (uint32, plaintext bytes per chunk)
    chunk_i  = nonce_i (12 bytes, fresh from os.urandom) ‖ ciphertext_i ‖ tag_i (16 bytes)
    object   = header ‖ chunk_0 ‖ chunk_1 ‖ … ‖ chunk_{n-1}

Every chunk but the last holds exactly ``chunk_bytes`` of plaintext; the last holds 0..``chunk_bytes``
(an empty file is one empty final chunk, 28 bytes). Each chunk is authenticated with associated data ::

    aad_i = header ‖ relpath (UTF-8, the file's path inside the checkpoint, e.g. "deepspeed/model.pt")
            ‖ b"\\0" ‖ i (uint64) ‖ final (1 byte: 1 for the last chunk, else 0)

so a chunk cannot be moved to another file (relpath), to another position (i), and an object cut at a
chunk boundary fails (its new last chunk was sealed with final=0); the header (hence chunk_bytes) is
authenticated too. A wrong key, a flipped byte, truncation, reordering or swapping two objects all raise
``CheckpointError`` naming the file with "authentication failed"; plaintext is written to ``dst`` only
chunk by chunk after each chunk authenticates, and callers write into a temp dir they delete on error.

The 32-byte key never travels with the archive: it comes from a key file or an environment variable
(``learner.archive.ArchiveConfig``). With a fresh random 96-bit nonce per chunk, one key is good for
well under 2**32 chunks (NIST SP 800-38D §8.3) — at 64 MiB chunks that is 256 PiB of checkpoints.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import BinaryIO

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from gyre.learner.checkpoint.store import CheckpointError

MAGIC = b"GYREAE1\0"
HEADER_BYTES = len(MAGIC) + 4
NONCE_BYTES = 12
TAG_BYTES = 16
KEY_BYTES = 32
DEFAULT_CHUNK_BYTES = 64 << 20
MAX_CHUNK_BYTES = (1 << 31) - 1


def parse_key(raw: bytes, source: str) -> bytes:
    """A 32-byte AES-256 key from ``raw``: exactly 32 bytes are taken as is; otherwise, after stripping
    whitespace, 64 hex characters. ``source`` names where it came from (for the error).

    Raises:
        ValueError: neither form, naming ``source`` and the length found.
    """
    if len(raw) == KEY_BYTES:
        return bytes(raw)
    text = raw.strip()
    if len(text) == 2 * KEY_BYTES:
        try:
            return bytes.fromhex(text.decode("ascii"))
        except (UnicodeDecodeError, ValueError):
            pass
    raise ValueError(f"{source}: key is {len(raw)} bytes ({len(text)} after stripping whitespace); AES-256-GCM "
                     f"needs exactly {KEY_BYTES} raw bytes or {2 * KEY_BYTES} hex characters")


def load_key(key_file: Path | None = None, key_env: str | None = None) -> bytes:
    """Read the key from ``key_file`` (raw or hex) or the environment variable ``key_env`` (hex, or 32
    ASCII characters taken as raw bytes). Exactly one must be given.

    Raises:
        ValueError: no source, both sources, unreadable file, unset variable, or a key of the wrong length.
    """
    if (key_file is None) == (key_env is None):
        raise ValueError(f"exactly one of key_file ({key_file}) and key_env ({key_env!r}) must be set")
    if key_file is not None:
        try:
            return parse_key(Path(key_file).read_bytes(), f"key_file {key_file}")
        except OSError as exc:
            raise ValueError(f"key_file {key_file} cannot be read: {exc}") from exc
    value = os.environ.get(key_env)
    if value is None:
        raise ValueError(f"key_env: environment variable {key_env!r} is not set")
    return parse_key(value.encode(), f"key_env ${key_env}")


def _aad(header: bytes, relpath: str, index: int, final: bool) -> bytes:
    return header + relpath.encode() + b"\0" + struct.pack(">QB", index, int(final))


def encrypt_stream(src: BinaryIO, dst: BinaryIO, key: bytes, relpath: str,
                   chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Encrypt everything readable from ``src`` into ``dst`` in the module's format, bound to
    ``relpath``; returns the plaintext bytes. ``src.read(n)`` may return fewer than ``n`` bytes."""
    if not 1 <= chunk_bytes <= MAX_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes ({chunk_bytes}) must be in [1, {MAX_CHUNK_BYTES}]")
    aead, header = AESGCM(key), MAGIC + struct.pack(">I", chunk_bytes)
    dst.write(header)
    total, index, chunk = 0, 0, _read_full(src, chunk_bytes)
    while True:
        nxt = _read_full(src, chunk_bytes) if len(chunk) == chunk_bytes else b""
        final = not nxt
        nonce = os.urandom(NONCE_BYTES)
        dst.write(nonce)
        dst.write(aead.encrypt(nonce, chunk, _aad(header, relpath, index, final)))
        total += len(chunk)
        if final:
            return total
        chunk, index = nxt, index + 1


def decrypt_stream(src: BinaryIO, dst: BinaryIO, key: bytes, relpath: str) -> int:
    """Decrypt an object written by ``encrypt_stream`` for ``relpath`` into ``dst``; returns the
    plaintext bytes. Only authenticated plaintext is written.

    Raises:
        CheckpointError: not in this format (no header), or "authentication failed" at a chunk (wrong key,
            tampered, truncated, reordered or swapped object), naming ``relpath`` and the chunk index.
    """
    header = _read_full(src, HEADER_BYTES)
    if len(header) != HEADER_BYTES or header[:len(MAGIC)] != MAGIC:
        raise CheckpointError(f"{relpath}: not an encrypted gyre object (header {header[:len(MAGIC)]!r}, expected "
                              f"{MAGIC!r}); was it archived with encrypt=False?")
    (chunk_bytes,) = struct.unpack(">I", header[len(MAGIC):])
    if chunk_bytes < 1:
        raise CheckpointError(f"{relpath}: header says chunk_bytes {chunk_bytes}; expected >= 1 (corrupt header)")
    aead, sealed = AESGCM(key), chunk_bytes + NONCE_BYTES + TAG_BYTES
    total, index, block = 0, 0, _read_full(src, sealed)
    while True:
        nxt = _read_full(src, sealed) if len(block) == sealed else b""
        final = not nxt
        if len(block) < NONCE_BYTES + TAG_BYTES:
            raise CheckpointError(f"{relpath}: authentication failed at chunk {index}: only {len(block)} bytes "
                                  f"left, a chunk needs at least {NONCE_BYTES + TAG_BYTES} (truncated object)")
        try:
            view = memoryview(block)
            plain = aead.decrypt(view[:NONCE_BYTES], view[NONCE_BYTES:], _aad(header, relpath, index, final))
        except InvalidTag:  # recovery path: report which file and chunk is bad, never write it
            raise CheckpointError(f"{relpath}: authentication failed at chunk {index} (wrong key, or the object "
                                  "was tampered with, truncated, reordered or swapped with another file)") from None
        dst.write(plain)
        total += len(plain)
        if final:
            return total
        block, index = nxt, index + 1


def _read_full(src: BinaryIO, n: int) -> bytes:
    """Up to ``n`` bytes, fewer only at end of stream (network streams may return short reads)."""
    parts, got = [], 0
    while got < n:
        part = src.read(n - got)
        if not part:
            break
        parts.append(part)
        got += len(part)
    return b"".join(parts)
