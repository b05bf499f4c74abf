"""On-disk format of a run of KV blocks: one file, one header, page-aligned payloads.

Layout, little-endian (struct formats in brackets):
  prefix    magic b"KVTIERB\\0" [8s], format version [I], header size in bytes [I]
  body      namespace [16s], dtype name, ASCII NUL-padded [16s], ndim [I], block count [I],
            block shape [ndim × Q],
            per block: key [16s], token count [I], offset [Q], length [Q], xxh3_64 of payload [Q]
  checksum  xxh3_64 of prefix + body [Q]
  payloads  each at a multiple of 4096 bytes from the file start, zero-padded in between

A reader trusts a header only after its magic, version, checksum and payload bounds check
out, and a payload only after its own checksum does. Token count 0 means "not recorded".
"""
from __future__ import annotations

import fcntl
import math
import os
import struct
from dataclasses import dataclass

import torch
import xxhash

from kvtier.kv.keys import KEY_BYTES
from kvtier.kv.tiers.files import atomic_write

MAGIC = b"KVTIERB\0"
VERSION = 1
ALIGN = 4096
MAX_NDIM = 8
MAX_BLOCKS = 1 << 16               # per file: bounds the header a reader accepts
PREFIX = struct.Struct("<8sII")
BODY = struct.Struct("<16s16sII")
DIM = struct.Struct("<Q")
ENTRY = struct.Struct("<16sIQQQ")
CHECKSUM = struct.Struct("<Q")
DTYPES = {str(d).removeprefix("torch."): d for d in
          (torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2)}


class BlockFileError(ValueError):
    """A damaged block file: short, inconsistent, or failing a checksum."""


class UnknownVersion(BlockFileError):
    """A block file written in another format version."""


@dataclass(eq=False)
class Header:
    namespace: bytes
    dtype: str                      # a key of DTYPES
    block_shape: tuple[int, ...]
    keys: list[bytes]
    token_counts: list[int]
    offsets: list[int]
    lengths: list[int]
    checksums: list[int]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def header_size(ndim: int, count: int) -> int:
    return PREFIX.size + BODY.size + ndim * DIM.size + count * ENTRY.size + CHECKSUM.size


def file_size(count: int, ndim: int, block_bytes: int) -> int:
    """Size of a file of `count` blocks of `block_bytes` each."""
    return _align(header_size(ndim, count)) + (count - 1) * _align(block_bytes) + block_bytes


def write_block_file(path: str, namespace: bytes, block_shape: tuple[int, ...], dtype: torch.dtype,
                     keys: list[bytes], payloads: list[torch.Tensor], token_counts: list[int]) -> Header:
    """Write the blocks to `path` atomically (see files.atomic_write)."""
    block_shape = tuple(block_shape)
    if not 1 <= len(keys) <= MAX_BLOCKS or len(payloads) != len(keys) or len(token_counts) != len(keys):
        raise ValueError(f"a block file needs 1 to {MAX_BLOCKS} keys and one payload and token count per key, got "
                         f"{len(keys)} keys, {len(payloads)} payloads, {len(token_counts)} token counts")
    if len(namespace) != KEY_BYTES or any(len(k) != KEY_BYTES for k in keys):
        raise ValueError(f"namespace and keys must be {KEY_BYTES} bytes")
    if dtype_name(dtype) not in DTYPES or len(block_shape) > MAX_NDIM:
        raise ValueError(f"block files hold up to {MAX_NDIM}-d blocks of {sorted(DTYPES)}, "
                         f"got {block_shape} {dtype}")
    for p in payloads:
        if tuple(p.shape) != block_shape or p.dtype != dtype or p.device.type != "cpu":
            raise ValueError(f"payload {tuple(p.shape)} {p.dtype} on {p.device} is not a CPU "
                             f"{block_shape} {dtype} block")
    data = [p.contiguous().view(-1).view(torch.uint8).numpy() for p in payloads]
    block_bytes = math.prod(block_shape) * dtype.itemsize
    stride = _align(block_bytes)
    start = _align(header_size(len(block_shape), len(keys)))
    header = Header(namespace, dtype_name(dtype), block_shape, list(keys), list(token_counts),
                    offsets=[start + i * stride for i in range(len(keys))],
                    lengths=[block_bytes] * len(keys),
                    checksums=[xxhash.xxh3_64_intdigest(d) for d in data])
    head = _pack_header(header)
    pad = memoryview(bytes(stride - block_bytes))
    buffers = [head + bytes(start - len(head))]
    for d in data:
        buffers += [d, pad]

    atomic_write(path, buffers[:-1])   # no padding after the last payload
    return header


def read_header(path: str) -> Header:
    """The header of a block file; raises BlockFileError (UnknownVersion) if it cannot be trusted."""
    with open(path, "rb", buffering=0) as f:
        data = f.read(ALIGN)
        if len(data) < PREFIX.size:
            raise BlockFileError(f"{path}: {len(data)} bytes is too short for a header")
        magic, version, size = PREFIX.unpack_from(data)
        if magic != MAGIC:
            raise BlockFileError(f"{path}: not a kvtier block file (magic {magic!r})")
        if version != VERSION:
            raise UnknownVersion(f"{path}: format version {version}, this build reads {VERSION}")
        if size < header_size(0, 0) or size > header_size(MAX_NDIM, MAX_BLOCKS):
            raise BlockFileError(f"{path}: implausible header size {size}")
        if size > len(data):
            data += f.read(size - len(data))
        file_bytes = os.fstat(f.fileno()).st_size
    if len(data) < size:
        raise BlockFileError(f"{path}: truncated header ({len(data)} of {size} bytes)")
    (checksum,) = CHECKSUM.unpack_from(data, size - CHECKSUM.size)
    if xxhash.xxh3_64_intdigest(data[:size - CHECKSUM.size]) != checksum:
        raise BlockFileError(f"{path}: header fails its checksum")
    header = _unpack_header(path, data, size)
    end = max(o + n for o, n in zip(header.offsets, header.lengths))
    if end > file_bytes:
        raise BlockFileError(f"{path}: truncated ({file_bytes} bytes, payloads end at {end})")
    return header


def read_span(header: Header, indices: list[int]) -> tuple[int, int]:
    """The byte range of the file from the first to the last of these payloads."""
    return (min(header.offsets[i] for i in indices), max(header.offsets[i] + header.lengths[i] for i in indices))


def read_blocks(path: str, header: Header, indices: list[int], into: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Blocks `indices` of the file as CPU tensors, checksum-verified.

    The byte range from the first to the last wanted payload is read in one call into one
    buffer (`into`, uint8 and large enough, or a new one); the blocks are views of it."""
    if not indices:
        return []
    start, end = read_span(header, indices)
    buf = torch.empty(end - start, dtype=torch.uint8) if into is None else into[:end - start]
    with open(path, "rb", buffering=0) as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_SH)     # an evictor in another process leaves the file alone
        f.seek(start)
        view, got = memoryview(buf.numpy()), 0
        while got < len(view):
            n = f.readinto(view[got:])
            if not n:
                raise BlockFileError(f"{path}: truncated ({start + got} bytes, payloads end at {end})")
            got += n
    dtype = DTYPES[header.dtype]
    blocks = []
    for i in indices:
        lo = header.offsets[i] - start
        block = buf[lo:lo + header.lengths[i]]
        if xxhash.xxh3_64_intdigest(block.numpy()) != header.checksums[i]:
            raise BlockFileError(f"{path}: block {i} fails its checksum")
        blocks.append(block.view(dtype).view(header.block_shape))
    return blocks


def _pack_header(h: Header) -> bytes:
    size = header_size(len(h.block_shape), len(h.keys))
    parts = [PREFIX.pack(MAGIC, VERSION, size),
             BODY.pack(h.namespace, h.dtype.encode(), len(h.block_shape), len(h.keys))]
    parts += [DIM.pack(d) for d in h.block_shape]
    parts += [ENTRY.pack(*e) for e in zip(h.keys, h.token_counts, h.offsets, h.lengths, h.checksums)]
    data = b"".join(parts)
    return data + CHECKSUM.pack(xxhash.xxh3_64_intdigest(data))


def _unpack_header(path: str, data: bytes, size: int) -> Header:
    namespace, dtype, ndim, count = BODY.unpack_from(data, PREFIX.size)
    dtype = dtype.rstrip(b"\0").decode("ascii", "replace")
    if ndim > MAX_NDIM or count < 1 or header_size(ndim, count) != size or dtype not in DTYPES:
        raise BlockFileError(f"{path}: inconsistent header ({ndim}-d {dtype!r} blocks, {count} of them, {size} bytes)")
    pos = PREFIX.size + BODY.size
    shape = tuple(DIM.unpack_from(data, pos + i * DIM.size)[0] for i in range(ndim))
    pos += ndim * DIM.size
    entries = [ENTRY.unpack_from(data, pos + i * ENTRY.size) for i in range(count)]
    keys, token_counts, offsets, lengths, checksums = (list(c) for c in zip(*entries))
    block_bytes = math.prod(shape) * DTYPES[dtype].itemsize
    if any(o % ALIGN or n != block_bytes for o, n in zip(offsets, lengths)):
        raise BlockFileError(f"{path}: payload offsets or lengths do not match {shape} {dtype} blocks")
    return Header(namespace, dtype, shape, keys, token_counts, offsets, lengths, checksums)
