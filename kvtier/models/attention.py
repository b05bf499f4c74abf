"""Attention over the paged KV pool.

The model sees the pool only through `AttentionMetadata`: where each new token's K/V
goes (`slot_mapping`) and, per sequence, which slots hold its whole context.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillSeq:
    query_start: int          # first row of this sequence in the flat token batch
    query_len: int
    kv_slots: torch.Tensor    # [kv_len] pool slots of positions 0..kv_len-1
    causal_mask: torch.Tensor | None  # [query_len, kv_len] bool, None when query_len == kv_len


@dataclass
class DecodeGroup:
    query_rows: torch.Tensor  # [B] rows of the flat batch that decode one token each
    kv_slots: torch.Tensor    # [B, max_kv_len] pool slots, padded with slot 0
    mask: torch.Tensor        # [B, 1, 1, max_kv_len] bool, True where a real slot is


@dataclass
class AttentionMetadata:
    positions: torch.Tensor       # [T] position of every token in the flat batch
    slot_mapping: torch.Tensor    # [T] pool slot where each token's K/V is written
    prefills: list[PrefillSeq]
    decode: DecodeGroup | None


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KVH, D]; caches: [num_slots, KVH, D]. Returns [T, H, D]."""
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)
    gqa = q.shape[1] != k.shape[1]
    for seq in meta.prefills:
        rows = slice(seq.query_start, seq.query_start + seq.query_len)
        qs = q[rows].transpose(0, 1).unsqueeze(0)                 # [1, H, q, D]
        if seq.causal_mask is None:
            # the whole context is in this batch: use the fresh K/V, no gather needed
            ks, vs = k[rows], v[rows]
        else:
            ks, vs = k_cache[seq.kv_slots], v_cache[seq.kv_slots]
        ks = ks.transpose(0, 1).unsqueeze(0)                       # [1, KVH, kv, D]
        vs = vs.transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=seq.causal_mask,
                                           is_causal=seq.causal_mask is None,
                                           scale=scale, enable_gqa=gqa)
        out[rows] = o.squeeze(0).transpose(0, 1)
    if meta.decode is not None:
        d = meta.decode
        qs = q[d.query_rows].unsqueeze(2)                          # [B, H, 1, D]
        ks = k_cache[d.kv_slots].permute(0, 2, 1, 3)               # [B, KVH, L, D]
        vs = v_cache[d.kv_slots].permute(0, 2, 1, 3)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=d.mask, scale=scale, enable_gqa=gqa)
        out[d.query_rows] = o.squeeze(2)
    return out
