"""Which of a sequence's blocks the current queries would attend to most.

Each sealed block gets a summary of its keys, kept on the device beside the pool: per
16-token sub-block, layer, KV head and channel, the min, the max and the mean key (bounds
over 64 varied tokens are too loose to tell a needle from hay). A policy turns queries
into one logit per sub-block and a block takes its best sub-block's:
  quest    an upper bound of q·k over the block's keys, from the per-channel min and max;
  meankey  q · the block's mean key.
For every layer, query head and query row the logits become the blocks' shares of that
head's attention (softmax over blocks); a block's score is the largest share any head
gives it. Recall of a fact is the work of a few retrieval heads: summed over all heads,
their votes drown in the others' (measured on an 8K chat: the needle's block ranked 13th
summed, second by the largest share). (`lru` needs no summaries: the pager scores by recency.)
"""
from __future__ import annotations

import torch

SUB_BLOCK = 16
SUMMARIES = ("kmin", "kmax", "kmean")


class BlockSummaries:
    """Key summaries of one sequence's sealed blocks, in block order: `kmin`, `kmax` and `kmean`, each
    [blocks, sub_blocks, layers, kv_heads, head_dim]. They grow in buffers that double when full, so that
    scoring, every decode step, reads them without stacking per-block tensors again."""

    def __init__(self):
        self._buffers: dict[str, torch.Tensor] = {}
        self._len = 0

    def __len__(self) -> int:
        return self._len

    @property
    def kmin(self) -> torch.Tensor:
        return self._buffers["kmin"][:self._len]

    @property
    def kmax(self) -> torch.Tensor:
        return self._buffers["kmax"][:self._len]

    @property
    def kmean(self) -> torch.Tensor:
        return self._buffers["kmean"][:self._len]

    def add(self, keys: torch.Tensor) -> None:
        """keys: [layers, block_size, kv_heads, head_dim], one block's keys after RoPE."""
        layers, size, kv_heads, dim = keys.shape
        sub = min(SUB_BLOCK, size)
        keys = keys.float().reshape(layers, size // sub, sub, kv_heads, dim).transpose(0, 1)
        self.extend({"kmin": keys.amin(2)[None], "kmax": keys.amax(2)[None], "kmean": keys.mean(2)[None]})

    def extend(self, parts: dict[str, torch.Tensor]) -> None:
        """Append more blocks' summaries: {name: [blocks, ...]} for each of SUMMARIES."""
        end = self._len + len(parts["kmin"])
        for name in SUMMARIES:
            buffer = self._buffers.get(name)
            if buffer is None or len(buffer) < end:
                grown = parts[name].new_empty((max(end, 2 * self._len), *parts[name].shape[1:]))
                if buffer is not None:
                    grown[:self._len] = buffer[:self._len]
                self._buffers[name] = buffer = grown
            buffer[self._len:end] = parts[name]
        self._len = end


def attention_share(policy: str, summaries: BlockSummaries, queries: torch.Tensor, scale: float) -> torch.Tensor:
    """Scores [num_blocks] for queries [rows, layers, heads, head_dim] (after RoPE)."""
    rows, layers, heads, dim = queries.shape
    kv_heads = summaries.kmin.shape[3]
    q = queries.float().reshape(rows, layers, kv_heads, heads // kv_heads, dim)
    if policy == "quest":
        # max over a block's keys of q·k ≤ Σ_d max(q_d·min_d, q_d·max_d)
        logits = (torch.einsum("nslkd,rlkgd->nslkrg", summaries.kmax, q.clamp(min=0))
                  + torch.einsum("nslkd,rlkgd->nslkrg", summaries.kmin, q.clamp(max=0)))
    elif policy == "meankey":
        logits = torch.einsum("nslkd,rlkgd->nslkrg", summaries.kmean, q)
    else:
        raise ValueError(f"no key summaries for policy {policy!r}")
    shares = (logits.amax(1) * scale).softmax(0)      # [blocks, layers, kv_heads, rows, group]
    return shares.flatten(1).amax(1)
