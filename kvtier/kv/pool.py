"""The device KV pool: one preallocated store of fixed-size blocks shared by all sequences."""
from __future__ import annotations

import os
from collections import deque

import torch

CPU_POOL_SHARE = 0.10    # of available host RAM when --kv-pool-tokens is not given
CUDA_POOL_SHARE = 0.80   # of free device memory after the weights are loaded


class PoolExhausted(RuntimeError):
    """Not enough free blocks for an allocation; the caller should have checked can_allocate."""


def default_pool_tokens(bytes_per_token: int, device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = free * CUDA_POOL_SHARE
    else:
        budget = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") * CPU_POOL_SHARE
    return int(budget // bytes_per_token)


class KVPool:
    """K/V storage `[2, num_layers, num_blocks * block_size, num_kv_heads, head_dim]` plus a free list.

    Slot s of a layer holds one token's K (index 0) or V (index 1); block b owns slots
    b*block_size .. (b+1)*block_size - 1.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                 num_tokens: int, dtype: torch.dtype, device: torch.device):
        self.block_size = block_size
        self.num_blocks = num_tokens // block_size
        if self.num_blocks < 1:
            raise ValueError(f"KV pool of {num_tokens} tokens holds no {block_size}-token block")
        # zeros, not empty: padded attention reads unused slots and NaN garbage would leak through softmax
        self.kv_cache = torch.zeros(2, num_layers, self.num_blocks * block_size, num_kv_heads, head_dim,
                                    dtype=dtype, device=device)
        self._free: deque[int] = deque(range(self.num_blocks))

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks > len(self._free):
            raise PoolExhausted(f"asked for {num_blocks} blocks, {len(self._free)} free")
        return [self._free.popleft() for _ in range(num_blocks)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(blocks)
