"""Attention over the paged KV pool.

The model sees the pool only through `AttentionMetadata`: where each new token's K/V
goes (`slot_mapping`) and, per sequence, which slots hold its context. Under bounded
residency a decode attends to the resident slots only, while a prefill chunk also gets the
paged-out blocks' K/V, streamed to the device one layer at a time, so prompts are computed
exactly. It can also hand back some rows' queries, which the pager scores blocks with.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillSeq:
    query_start: int                  # first row of this sequence in the flat token batch
    query_len: int
    prefix_slots: torch.Tensor | None  # pool slots of the positions before this chunk; None if there are none
    # K/V of the blocks before this chunk that are not resident [2, layers, tokens, kv_heads, head_dim], in host
    # memory; each layer's slice visits the device only while that layer attends (bounded residency)
    paged_out: torch.Tensor | None = None


@dataclass
class DecodeGroup:
    query_rows: torch.Tensor  # [B] rows of the flat batch that decode one token each
    kv_slots: torch.Tensor    # [B, max_kv_len] pool slots of each context, padded with slot 0
    mask: torch.Tensor        # [B, 1, 1, max_kv_len] bool, True where a real slot is


@dataclass
class AttentionMetadata:
    positions: torch.Tensor       # [T] position of every token in the flat batch
    slot_mapping: torch.Tensor    # [T] pool slot where each token's K/V is written
    prefills: list[PrefillSeq]
    decode: DecodeGroup | None
    capture_rows: torch.Tensor | None = None   # rows whose queries each layer appends to `captured`
    captured: list[torch.Tensor] = field(default_factory=list)   # per layer [len(capture_rows), H, D]
    layer: int = 0                             # the layer being computed, set by the decoder


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KVH, D]; caches: [num_slots, KVH, D]. Returns [T, H, D]."""
    if meta.capture_rows is not None:
        meta.captured.append(q.index_select(0, meta.capture_rows))
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)
    gqa = q.shape[1] != k.shape[1]
    for seq in meta.prefills:
        rows = slice(seq.query_start, seq.query_start + seq.query_len)
        qs, ks, vs = (x[rows].transpose(0, 1).unsqueeze(0) for x in (q, k, v))   # [1, heads, n, D]
        if seq.prefix_slots is None:
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            kp, vp = (c[seq.prefix_slots] for c in (k_cache, v_cache))
            if seq.paged_out is not None:     # prompt tokens attend to every earlier block, resident or not
                kp = torch.cat([kp, seq.paged_out[0, meta.layer].to(kp.device, non_blocking=True)])
                vp = torch.cat([vp, seq.paged_out[1, meta.layer].to(vp.device, non_blocking=True)])
            kp, vp = (x.transpose(0, 1).unsqueeze(0) for x in (kp, vp))
            o = _attention_after_prefix(qs, ks, vs, kp, vp, scale)
        out[rows] = o.squeeze(0).transpose(0, 1)
    if meta.decode is not None:
        d = meta.decode
        qs = q[d.query_rows].unsqueeze(2)                          # [B, H, 1, D]
        ks = k_cache[d.kv_slots].permute(0, 2, 1, 3)               # [B, KVH, L, D]
        vs = v_cache[d.kv_slots].permute(0, 2, 1, 3)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=d.mask, scale=scale, enable_gqa=gqa)
        out[d.query_rows] = o.squeeze(2)
    return out


def _attention_after_prefix(q, k, v, k_prefix, v_prefix, scale: float) -> torch.Tensor:
    """Causal attention of a chunk over [cached prefix | the chunk itself]; tensors [1, heads, len, D]."""
    if q.device.type != "cpu":
        n, p = q.shape[2], k_prefix.shape[2]
        mask = torch.ones(n, p + n, dtype=torch.bool, device=q.device).tril(diagonal=p)
        return F.scaled_dot_product_attention(q, torch.cat([k_prefix, k], 2), torch.cat([v_prefix, v], 2),
                                              attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    # CPU: a masked call computes every masked-out score; instead attend to the prefix (no mask) and to
    # the chunk (causal) separately with the flash kernel and merge the two by their log-sum-exp
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    groups = q.shape[1] // k.shape[1]
    o1, lse1 = flash(q, k_prefix.repeat_interleave(groups, 1), v_prefix.repeat_interleave(groups, 1), scale=scale)
    o2, lse2 = flash(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), is_causal=True, scale=scale)
    lse = torch.logaddexp(lse1, lse2).unsqueeze(-1)
    return o1 * (lse1.unsqueeze(-1) - lse).exp() + o2 * (lse2.unsqueeze(-1) - lse).exp()
