"""A read buffer allocated once and reused: for the tiers that read into one (the disk tier) and for the gather of
paged-out blocks."""
from __future__ import annotations

import torch


class Staging:
    """Consecutive pieces of one fixed buffer (bytes). Reading into fresh memory pays a page fault per page, which on
    this kind of machine halves the file-read rate, so the buffer is carved from the host tier's slab at start-up
    (within its budget; pinned for a CUDA pool, so the copy to the device that follows is DMA), faulted in before
    serving, and never grown: a read larger than it goes to fresh buffers."""

    def __init__(self, buffer: torch.Tensor | None = None):
        self.buffer = torch.empty(0, dtype=torch.uint8) if buffer is None else buffer

    def split(self, sizes: list[int]) -> list[torch.Tensor | None]:
        """Pieces of the buffer of these sizes, one after another: each that fits after those before it, None for
        one that does not (it goes to fresh memory)."""
        pieces, start = [], 0
        for size in sizes:
            fits = start + size <= self.buffer.numel()
            pieces.append(self.buffer[start:start + size] if fits else None)
            start += size if fits else 0
        return pieces

    def fault_in(self) -> None:
        """Touch every page now, at start-up, so that no request pays for the page faults."""
        self.buffer.zero_()
