"""The device KV pool: one preallocated store of fixed-size blocks shared by all sequences.

Blocks are reference-counted. A full block can be sealed under its content key; once its
last user lets go it stays cached, evictable, in an LRU free list, and a later request
whose prefix has the same keys reuses it instead of recomputing it.

Allocation keeps each sequence's blocks in long runs of consecutive slots where it can: the CPU
attention reads a run of slots in one call, so a context scattered over many runs costs a call
(or a gather) per run. A sequence grows into the empty block after its last one; one that cannot
(a new sequence, or its neighbour took that block) starts in the longest run of empty blocks,
with the blocks it may come to want (its prompt's and its answer's) in the middle of the run
where they fit, from the run's start where not, so that sequences growing side by side get room
apart and a long prompt in a tight pool still lies in one run. Empty blocks go before cached ones are evicted.
"""
from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Iterator

import numpy as np
import torch

CPU_POOL_SHARE = 0.10    # of available host RAM when --kv-pool-tokens is not given
CUDA_POOL_SHARE = 0.80   # of free device memory after the weights are loaded
STAGE_BYTES = 64 << 20   # the most a transfer stages on the device at once (blocks_out, blocks_in)
TAIL_KEYS = 64           # a transposed pool's slots past its padding block, at least: ggml reads up to 63 past a
                         # context's end


class PoolExhausted(RuntimeError):
    """Not enough free blocks for an allocation; the caller should have checked can_allocate."""


def available_host_bytes() -> int:
    """Host memory new allocations can take: the kernel's MemAvailable (free pages and the page cache it can drop:
    a weight file just read sits there, and would otherwise count as used beside the weights' own copy), else free
    pages only where there is no /proc/meminfo."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def default_pool_tokens(bytes_per_token: int, device: torch.device, held: int = 0, reserve: int = 0,
                        utilization: float | None = None) -> int:
    """held: device bytes the engine's weights take; reserve: those that something not yet on a CUDA device will take
    (a drafter's weights); utilization: --gpu-memory-utilization."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = cuda_pool_budget(free, total, held, reserve, utilization)
    else:
        budget = available_host_bytes() * CPU_POOL_SHARE
    return int(budget // bytes_per_token)


def cuda_pool_budget(free: int, total: int, held: int, reserve: int, utilization: float | None) -> float:
    """Device bytes for the pool: CUDA_POOL_SHARE of what is free after the weights and `reserve`; under a
    utilization, no more than what that fraction of the device leaves after the engine's weights (held) and `reserve`,
    so that engines sharing a GPU each keep to their fraction."""
    budget = max(0, free - reserve) * CUDA_POOL_SHARE
    if utilization is None:
        return budget
    return max(0.0, min(budget, utilization * total - held - reserve))


class KVPool:
    """K/V storage `[2, num_layers, (num_blocks + 1) * block_size, num_kv_heads, head_dim]` plus a free list; the
    model reads and writes it through `k_cache` and `v_cache`, the tiers through the block copies. A CPU pool for
    ggml's decode steps keeps each layer's V transposed (`values_transposed`: [num_kv_heads, head_dim, slots], which
    `v_cache` views as the others), plus TAIL_KEYS slots or more that no block owns.

    Slot s of a layer holds one token's K (index 0) or V (index 1); block b owns slots
    b*block_size .. (b+1)*block_size - 1. A block's payload, what the tiers hold for it, is [2, num_layers,
    block_size, num_kv_heads, head_dim]; a transposed pool's V half holds V as the pool keeps it, [num_layers,
    num_kv_heads, head_dim, block_size] (`payload_kv` reads either), so its copies move runs of slots instead of
    transposing V (2x as fast), and its namespace names that layout (`layout`): its blocks are no other pool's.
    """

    LAYOUT = "kv[2,layer,slot,kv_head,head_dim]"
    TRANSPOSED_LAYOUT = "k[layer,slot,kv_head,head_dim]+v[layer,kv_head,head_dim,slot]"

    @classmethod
    def layout(cls, values_transposed: bool) -> str:
        """The payload layout a pool's namespace names."""
        return cls.TRANSPOSED_LAYOUT if values_transposed else cls.LAYOUT

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                 num_tokens: int, dtype: torch.dtype, device: torch.device,
                 namespace: bytes = b"", prefix_cache: bool = True, values_transposed: bool = False):
        self.block_size = block_size
        self.num_blocks = num_tokens // block_size
        if self.num_blocks < 1:
            raise ValueError(f"KV pool of {num_tokens} tokens holds no {block_size}-token block")
        # On CUDA not zero-filled: start-up would write the whole pool (most of a GPU's memory). Attention reads
        # only written slots, but for slot 0, which pads a batch of decode contexts: masked out, yet NaN garbage
        # there would leak through the softmax, so its block starts as zeros. On CPU the whole pool is zeroed once
        # at start-up, which maps all its pages: a block's slots lie in 2 x num_layers places, and faulting them in
        # on first use cost a step 10-100 ms (a warm turn's copy of a partial block: 102 of its 555 ms).
        # One more block past the last is never handed out: the padding rows of a graph-captured decode step write
        # and read their K/V there (pad_slot).
        # each layer's K and V, [num_layers, num_slots, num_kv_heads, head_dim] each, for the model's attention
        slots = (self.num_blocks + 1) * block_size
        self.values_transposed = values_transposed
        if values_transposed:     # on CPU only: its K and V apart, no one tensor (_kv) holds both
            slots += -(-TAIL_KEYS // block_size) * block_size
            storage = torch.zeros(2, num_layers, slots * num_kv_heads * head_dim, dtype=dtype)
            self._kv = None
            self.k_cache = storage[0].view(num_layers, slots, num_kv_heads, head_dim)
            self.v_cache = storage[1].view(num_layers, num_kv_heads, head_dim, slots).permute(0, 3, 1, 2)
            self._staging = threading.local()     # per mover thread: a block's payload on its way out
        else:
            self._kv = torch.empty(2, num_layers, slots, num_kv_heads, head_dim, dtype=dtype, device=device)
            (self._kv if self._kv.device.type == "cpu" else self._kv[:, :, :block_size]).zero_()
            self.k_cache, self.v_cache = self._kv[0], self._kv[1]
        self.pad_slot = self.num_blocks * block_size
        # transfers to and from the tiers go through a contiguous device buffer on CUDA (see blocks_out)
        self.staged_copies = self.device.type == "cuda"
        self.namespace = namespace
        self.prefix_cache = prefix_cache
        self.ref_counts = [0] * self.num_blocks
        self.keys: list[bytes | None] = [None] * self.num_blocks   # sealed blocks' content keys
        self.cached: dict[bytes, int] = {}                          # key → block holding it
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(self.num_blocks))  # LRU first
        self._empty = np.ones(self.num_blocks, dtype=bool)    # free and holding no cached block

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * dtype.itemsize

    @property
    def dtype(self) -> torch.dtype:
        return self.k_cache.dtype

    @property
    def device(self) -> torch.device:
        return self.k_cache.device

    @property
    def num_slots(self) -> int:
        """Slots of each layer's K (and V), the padding block's included."""
        return self.k_cache.shape[1]

    @property
    def caches(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache), as the model's forward takes them."""
        return self.k_cache, self.v_cache

    def slots_kv(self, slots: torch.Tensor) -> torch.Tensor:
        """A copy of the K/V at these slots, [2, num_layers, len(slots), num_kv_heads, head_dim]."""
        return torch.stack([self.k_cache[:, slots], self.v_cache[:, slots]])

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    @property
    def num_empty_blocks(self) -> int:
        """Free blocks that hold no cached block: allocating them evicts nothing."""
        return int(self._empty.sum())

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int, after: int | None = None, wants: int = 0) -> list[int]:
        """Fresh blocks, continuing the run that ends at block `after` where the blocks after it are empty, else
        starting a run with room for `wants` blocks (the sequence's expected growth, these included) where there
        is; cached blocks are evicted (least recently freed first) only when no block is empty."""
        if num_blocks > len(self._free):
            raise PoolExhausted(f"asked for {num_blocks} blocks, {len(self._free)} free")
        blocks = []
        for _ in range(num_blocks):
            block = self._next_block(blocks[-1] if blocks else after, max(wants, num_blocks) - len(blocks))
            self._take(block)
            blocks.append(block)
        return blocks

    def allocate_run(self, num_blocks: int, wants: int = 0) -> list[int] | None:
        """num_blocks consecutive empty blocks (allocating them evicts nothing), placed as `allocate` places a new
        run, or None where no run of empty blocks is that long."""
        start, length = self._longest_empty_run()
        if length < num_blocks:
            return None
        first = self._placed_in(start, length, max(wants, num_blocks))
        blocks = list(range(first, first + num_blocks))
        for block in blocks:
            self._take(block)
        return blocks

    @staticmethod
    def consecutive(blocks: list[int]) -> bool:
        """Whether the blocks lie one after another in the pool (a list's compare, no numpy: a decode step asks it
        of each context)."""
        return blocks == list(range(blocks[0], blocks[0] + len(blocks)))

    def continues(self, block: int) -> bool:
        """Whether the block after `block` is empty: a run ending there can grow in place."""
        return block + 1 < self.num_blocks and bool(self._empty[block + 1])

    def _take(self, block: int) -> None:
        del self._free[block]
        self._empty[block] = False
        self._forget(block)
        self.ref_counts[block] = 1

    def _next_block(self, after: int | None, wants: int) -> int:
        if after is not None and self.continues(after):
            return after + 1
        if not self._empty.any():
            return next(iter(self._free))
        return self._placed_in(*self._longest_empty_run(), wants)

    def _longest_empty_run(self) -> tuple[int, int]:
        """(first block, length) of the longest run of empty blocks; length 0 where none is empty."""
        edges = np.diff(self._empty.astype(np.int8), prepend=0, append=0)     # +1 where a run starts, -1 past its end
        starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
        if not len(starts):
            return 0, 0
        longest = int(np.argmax(ends - starts))
        return int(starts[longest]), int(ends[longest] - starts[longest])

    @staticmethod
    def _placed_in(start: int, length: int, wants: int) -> int:
        """Where `wants` blocks go in an empty run: centred; from its start where they do not fit."""
        return start + max(0, length - wants + 1) // 2

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block. Tail blocks are queued for eviction before head
        blocks: a prefix's head is what the next request is most likely to share."""
        for block in reversed(blocks):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self._free[block] = None
                self._empty[block] = self.keys[block] is None

    def pin(self, blocks: list[int]) -> None:
        """One more reference to blocks someone already holds (e.g. while a copy out of them is in flight)."""
        for block in blocks:
            self.ref_counts[block] += 1

    def read_blocks(self, blocks: list[int]) -> torch.Tensor:
        """CPU copies of the blocks' payloads, one gather on the device and one copy: [n, 2, num_layers,
        block_size, num_kv_heads, head_dim] (a transposed pool's V halves as `payload_kv` reads them)."""
        if self.values_transposed:
            out = torch.empty(len(blocks), *self.block_shape, dtype=self.dtype)
            for block, payload in zip(blocks, out):
                self._transposed_payload(block, payload)
            return out
        index = torch.tensor(blocks, dtype=torch.long, device=self.device)
        return self._blocked().index_select(2, index).movedim(2, 0).to("cpu", copy=True).contiguous()

    def read_block(self, block: int) -> torch.Tensor:
        """A CPU copy of the block's payload, shaped [2, num_layers, block_size, num_kv_heads, head_dim]."""
        return self.read_blocks([block])[0]

    def block_kv(self, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's slots in the K and the V cache, [num_layers, block_size, num_kv_heads, head_dim] each."""
        bs = self.block_size
        return self.k_cache[:, block * bs:(block + 1) * bs], self.v_cache[:, block * bs:(block + 1) * bs]

    def _payload(self, block: int) -> torch.Tensor:
        """The block's payload [2, num_layers, block_size, num_kv_heads, head_dim], a view of its slots (a pool
        whose one tensor holds K and V alike)."""
        bs = self.block_size
        return self._kv[:, :, block * bs:(block + 1) * bs]

    def _transposed_payload(self, block: int, out: torch.Tensor) -> torch.Tensor:
        """A transposed pool's block copied into out as its payload (V as the pool keeps it: runs of slots)."""
        for half, part in zip(self.payload_kv(out), self.block_kv(block)):
            half.copy_(part)
        return out

    def payload_kv(self, payload: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A payload of this pool's as its K and V, [num_layers, block_size, num_kv_heads, head_dim] each (V a
        permuted view in a transposed pool's)."""
        if not self.values_transposed:
            return payload[0], payload[1]
        layers, _, heads, dim = self.k_cache.shape
        return payload[0], payload[1].reshape(layers, heads, dim, self.block_size).permute(0, 3, 1, 2)

    def _staged_payload(self) -> torch.Tensor:
        """The calling thread's memory for a transposed pool's payloads on their way out, allocated once (fresh
        memory would cost its page faults each block)."""
        kept = getattr(self._staging, "payload", None)
        if kept is None:
            kept = self._staging.payload = torch.empty(self.block_shape, dtype=self.dtype)
        return kept

    def blocks_out(self, blocks: list[int]) -> Iterator[torch.Tensor]:
        """The blocks' payloads, in order, to copy to a tier. A block's slots are 2 x num_layers strided pieces
        of the cache: on CUDA one gather (STAGE_BYTES at a time) lays the blocks out one after another, each
        contiguous, so each copy to host memory is one DMA at full rate, where a strided one goes through a
        temporary and a kernel. On CPU, views of the blocks themselves: a gather would be one more copy; a
        transposed pool's copies, each in the calling thread's memory and valid only until the next is taken
        (each consumer copies it into a tier first; `read_blocks` gives copies to keep)."""
        if self.values_transposed:
            out = self._staged_payload()
            yield from (self._transposed_payload(b, out) for b in blocks)
            return
        if not self.staged_copies:
            yield from (self._payload(b) for b in blocks)
            return
        for part in self._stage_parts(len(blocks)):
            index = torch.tensor(blocks[part], dtype=torch.long).to(self.device, non_blocking=True)
            yield from self._blocked().movedim(2, 0)[index]      # one gather, each block contiguous

    def blocks_in(self, blocks: list[int], payloads: list[torch.Tensor]) -> None:
        """Copy payloads (host memory, contiguous) into the blocks, without waiting on CUDA. There they land by
        one DMA each in a contiguous device buffer (STAGE_BYTES at a time), and one scatter puts each group in
        place; on CPU each is copied straight into its block."""
        if not self.staged_copies:
            for block, payload in zip(blocks, payloads):
                for part, half in zip(self.block_kv(block), self.payload_kv(payload)):
                    part.copy_(half)
            return
        for part in self._stage_parts(len(blocks)):
            group = blocks[part]
            staged = torch.empty((len(group), *self.block_shape), dtype=self.dtype, device=self.device)
            for row, payload in zip(staged, payloads[part]):
                row.copy_(payload, non_blocking=True)
            index = torch.tensor(group, dtype=torch.long).to(self.device, non_blocking=True)
            self._blocked().index_copy_(2, index, staged.movedim(0, 2))

    def _stage_parts(self, count: int) -> Iterator[slice]:
        """Consecutive slices of `count` blocks, each at most STAGE_BYTES."""
        step = max(1, STAGE_BYTES // self.block_bytes)
        return (slice(i, i + step) for i in range(0, count, step))

    def copy_block(self, src: int, dst: int) -> None:
        self.copy_blocks([src], dst)

    def copy_blocks(self, sources: list[int], first: int) -> None:
        """The blocks `sources` copied, in order, into the consecutive blocks from `first`, a run of consecutive
        sources at a time (two copies a run: its K and its V slots)."""
        bs, at = self.block_size, 0
        while at < len(sources):
            end = at + 1
            while end < len(sources) and sources[end] == sources[end - 1] + 1:
                end += 1
            src, dst = sources[at] * bs, (first + at) * bs
            for cache in self.caches:
                cache[:, dst:dst + (end - at) * bs].copy_(cache[:, src:src + (end - at) * bs])
            at = end

    def _blocked(self) -> torch.Tensor:
        """The cache viewed as [2, num_layers, num_blocks, block_size, num_kv_heads, head_dim]."""
        two, layers, _, heads, dim = self._kv.shape
        return self._kv[:, :, :self.pad_slot].view(two, layers, self.num_blocks, self.block_size, heads, dim)

    @property
    def block_bytes(self) -> int:
        return 2 * self.k_cache[:, :self.block_size].numel() * self.k_cache.element_size()

    @property
    def block_shape(self) -> tuple[int, ...]:
        layers, _, heads, dim = self.k_cache.shape
        return (2, layers, self.block_size, heads, dim)

    def match_prefix(self, keys: list[bytes]) -> list[int]:
        """The blocks of the longest run of leading keys cached here, referenced for the caller."""
        if not self.prefix_cache:
            return []
        blocks = []
        for key in keys:
            block = self.cached.get(key)
            if block is None:
                break
            blocks.append(block)
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self._free[block]
            self.ref_counts[block] += 1
        return blocks

    def seal(self, block: int, key: bytes) -> None:
        """Publish a full block under its content key (the first block with a key keeps it)."""
        if self.prefix_cache and key not in self.cached:
            self.cached[key] = block
            self.keys[block] = key

    def move_key(self, block: int, copy: int) -> None:
        """A free block's key given to a held copy of it: the prefix cache finds the copy, and the block is empty."""
        key = self.keys[block]
        self._forget(block)
        self._empty[block] = True
        if key is not None:
            self.seal(copy, key)

    def unseal(self, block: int) -> None:
        """Drop a held block's key (another block publishes it now)."""
        self._forget(block)

    def _forget(self, block: int) -> None:
        key = self.keys[block]
        if key is not None:
            del self.cached[key]
            self.keys[block] = None
