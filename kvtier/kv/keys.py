"""Content addresses of KV blocks.

A full block's key is H(parent key, the block's token ids, namespace), so a key names
the whole prefix up to the end of its block, and blocks computed by another model,
dtype, block size, layout or attention mode can never collide with ours. A request's
cache salt (a tenant, say) stands in as the first block's parent, so differently salted
requests never share a block.
"""
from __future__ import annotations

import array

import xxhash

KEY_BYTES = 16   # xxh3-128


def namespace(weights_fingerprint: str, dtype: str, block_size: int, layout: str,
              attention: str = "exact") -> bytes:
    """Everything that changes a block's bytes besides its tokens."""
    parts = f"weights={weights_fingerprint};dtype={dtype};block_size={block_size};layout={layout};attention={attention}"
    return xxhash.xxh3_128_digest(parts.encode())


def salt_root(cache_salt: str | None) -> bytes | None:
    """The parent of a salted sequence's first block: requests with different salts share no key."""
    return None if cache_salt is None else xxhash.xxh3_128_digest(b"cache_salt\0" + cache_salt.encode())


def block_key(parent: bytes | None, token_ids: list[int], ns: bytes) -> bytes:
    h = xxhash.xxh3_128()
    h.update(ns)
    h.update(parent or b"\0" * KEY_BYTES)
    h.update(array.array("q", token_ids).tobytes())
    return h.digest()


def chain_keys(token_ids: list[int], block_size: int, ns: bytes, parent: bytes | None = None) -> list[bytes]:
    """Keys of every full block of token_ids, in order."""
    keys = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_key(parent, token_ids[start:start + block_size], ns)
        keys.append(parent)
    return keys
