"""A DFlash block drafter (z-lab's `dflash`, arXiv 2602.06036): a few Qwen3-style layers that propose a block of
tokens in one forward, conditioned on the target model's hidden features.

The target's hidden states after `target_layer_ids` (concatenated per token) are projected (`fc`, `hidden_norm`)
into the drafter's context: every drafter layer takes its keys and values for a context token from that one
projected feature (k_norm and RoPE at the token's position). So a context token's K/V depend only on the target's
features at it, which depend only on the tokens up to it: they are cached like any K/V, in a pool of the drafter's
own (spec/dflash.py). A proposal feeds a block: the last token and `block_size - 1` mask tokens, embedded by the
target's embedding; each layer's queries of the block attend, without a causal mask, to the whole context and the
whole block; the target's LM head reads the block's rows after the first: the proposed tokens.

Checkpoints are directories as z-lab publishes them: a Qwen3 `config.json` with `block_size` and `dflash_config`
(`target_layer_ids`, `mask_token_id`), and safetensors with `fc`, `hidden_norm`, `norm` and `layers.N.*`.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
from safetensors import safe_open
from torch import nn

from kvtier.models.attention import sdpa
from kvtier.models.config import ModelConfig
from kvtier.models.decoder import DecoderLayer, RMSNorm, RotaryEmbedding, apply_rope
from kvtier.models.loader import _safetensors_files, fingerprint, hf_config
from kvtier.models.products import Linear


@dataclass(frozen=True)
class DFlashConfig:
    layers: ModelConfig                # the drafter's own layers (Qwen3: q/k norms)
    block_size: int                    # tokens a forward proposes after the last one, plus that one
    target_layer_ids: tuple[int, ...]  # the target layers whose outputs are its context features
    mask_token_id: int


class DFlashAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def kv(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (normed, rotated) and values [T, kv_heads, head_dim] of rows x [T, hidden]."""
        k = self.k_norm(self.k_proj(x).view(len(x), self.kv_heads, self.head_dim))
        return apply_rope(k, *rope), self.v_proj(x).view(len(x), self.kv_heads, self.head_dim)

    def forward(self, x: torch.Tensor, rope, context_k: torch.Tensor, context_v: torch.Tensor,
                meta=None) -> torch.Tensor:
        """meta: unused (the decoder layer's call passes its attention metadata)."""
        q = apply_rope(self.q_norm(self.q_proj(x).view(len(x), self.heads, self.head_dim)), *rope)
        k, v = self.kv(x, rope)
        k, v = torch.cat([context_k, k]), torch.cat([context_v, v])
        # [1, heads, T, D] over [1, kv_heads, context + T, D], no causal mask, a new context length every step (four
        # dimensions: CUDA's plan-free kernels take no other)
        o = sdpa(*(t.transpose(0, 1)[None] for t in (q, k, v)), enable_gqa=True)[0]
        return self.o_proj(o.transpose(0, 1).reshape(len(x), -1))


class DFlashLayer(DecoderLayer):
    """A decoder layer (norms, MLP) whose attention reads the drafter's context instead of the paged pool."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.self_attn = DFlashAttention(cfg)


class DFlash(nn.Module):
    def __init__(self, cfg: DFlashConfig, target_hidden: int):
        super().__init__()
        self.config = cfg
        hidden = cfg.layers.hidden_size
        self.fc = Linear(len(cfg.target_layer_ids) * target_hidden, hidden, bias=False)
        self.hidden_norm = RMSNorm(hidden, cfg.layers.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(cfg.layers) for _ in range(cfg.layers.num_layers))
        self.norm = RMSNorm(hidden, cfg.layers.rms_norm_eps)
        self.rope = RotaryEmbedding(cfg.layers)

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the K/V of context tokens at `positions` from the target's features there [T, F]."""
        x = self.hidden_norm(self.fc(features))
        rope = self.rope(positions, x.dtype)
        return [layer.self_attn.kv(x, rope) for layer in self.layers]

    def block(self, embedded: torch.Tensor, positions: torch.Tensor,
              context: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """The block's hidden rows [B, hidden] (embedded: the last token's and the mask tokens' embeddings)."""
        rope = self.rope(positions, embedded.dtype)
        x = embedded
        for layer, (k, v) in zip(self.layers, context):
            x = layer(x, rope, k, v, None)
        return self.norm(x)


def load_dflash(path: str, target: ModelConfig, dtype: torch.dtype, device: torch.device,
                digest_cache: str | None = None, positions: int = 0) -> tuple[DFlash, str]:
    """The drafter of a DFlash checkpoint directory, checked against its target, and its fingerprint; its RoPE
    covers `positions` where that is more than its context (`RotaryEmbedding`)."""
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    layers = hf_config(path)
    dflash = raw.get("dflash_config") or {}
    ids = tuple(dflash.get("target_layer_ids") or ())
    if not ids or dflash.get("mask_token_id") is None or not raw.get("block_size"):
        raise ValueError(f"{path}: not a DFlash drafter (config.json needs block_size and dflash_config with "
                         "target_layer_ids and mask_token_id)")
    if layers.hidden_size != target.hidden_size or max(ids) >= target.num_layers:
        raise ValueError(f"{path}: a drafter for another target (hidden size {layers.hidden_size}, target layers "
                         f"{list(ids)}; this model has {target.hidden_size} and {target.num_layers} layers)")
    cfg = DFlashConfig(layers, raw["block_size"], ids, dflash["mask_token_id"])
    with torch.device("meta"):
        model = DFlash(cfg, target.hidden_size)
    weights, files = {}, _safetensors_files(path)
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                weights[name] = f.get_tensor(name).to(device=device, dtype=dtype)
    for i in range(layers.num_layers):      # kvtier's MLP takes gate and up as one product
        gate, up = (weights.pop(f"layers.{i}.mlp.{p}_proj.weight") for p in ("gate", "up"))
        weights[f"layers.{i}.mlp.gate_up_proj.weight"] = torch.cat([gate, up])
    missing, unexpected = model.load_state_dict(weights, strict=False, assign=True)
    if missing or unexpected:
        raise ValueError(f"{path}: does not match a DFlash drafter: missing {missing[:5]}, unexpected "
                         f"{unexpected[:5]}")
    with torch.device(device):
        model.rope = RotaryEmbedding(layers, positions)
    return model.eval(), fingerprint(layers, files, digest_cache)
