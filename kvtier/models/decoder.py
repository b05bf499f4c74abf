"""One decoder for the Llama, Qwen2 and Qwen3 families.

Module names follow Hugging Face checkpoints, except that q/k/v and gate/up projections
are fused into one matrix each (`fuse_projections`): fewer, larger matmuls. Differences
between the families are flags on ModelConfig: q/k/v bias (Qwen2) and per-head q/k
RMSNorm (Qwen3).
"""
from __future__ import annotations

import functools
import logging
import math
import time

import torch
import torch.nn.functional as F
from torch import nn

from kvtier.models.attention import AttentionMetadata, paged_attention
from kvtier.models.config import ModelConfig

log = logging.getLogger("kvtier.models")


# On CPU, a product of up to this many rows (a decode step of a few sequences) takes the weight as BLAS's tall left
# matrix, one row padded to two. MKL's matrix-vector product (one row) reads the weight at about 10 GB/s where its
# two-column product reads it at about 29 GB/s, near the memory's read bandwidth: one row through SmolLM2's 30 layers
# takes 35 ms as F.linear and 15 ms padded to two, 2-4 rows about 2x less than F.linear (2-core EPYC, weights out of
# cache). More rows take many_rows_product: from 6 rows oneDNN's product is faster still, where it is chosen.
FEW_ROWS = 5


class Linear(nn.Linear):
    """nn.Linear, with the CPU products for a few rows (above) and for more (many_rows_product)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if x.device.type != "cpu" or rows == 0:
            return F.linear(x, self.weight, self.bias)
        if rows > FEW_ROWS:
            return many_rows_product(x.dtype)(x, self.weight, self.bias)
        padded = F.pad(x, (0, 0, 0, 1)) if rows == 1 else x
        y = (self.weight @ padded.T).T[:rows].contiguous()
        return y if self.bias is None else y + self.bias


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's product (the one torch.compile uses on CPU), where F.linear takes MKL's."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [None], "")


@functools.cache
def many_rows_product(dtype: torch.dtype):
    """F.linear or oneDNN's product on CPU for more than FEW_ROWS rows (decode batches, prompt chunks): whichever
    multiplies 256 rows faster on this CPU, timed once per process and dtype. On a 2-core EPYC oneDNN's is 1.2-1.4x
    faster (MKL takes a slower path on AMD CPUs): prefill of the bundled model 9-12% faster at 2K-4K tokens, the
    58-token turn after a cached 4K history 13% (A/B, alternating); MKL may win elsewhere. F.linear where this build
    of torch has no oneDNN product for the dtype, or it disagrees."""
    x, weight = torch.randn(256, 1024, dtype=dtype), torch.randn(2048, 1024, dtype=dtype)
    try:
        if not torch.allclose(onednn_linear(x, weight, None).float(), F.linear(x, weight).float(), rtol=1e-2,
                              atol=0.25):
            return F.linear
    except (RuntimeError, AttributeError):
        return F.linear
    best = dict.fromkeys((F.linear, onednn_linear), math.inf)     # seconds, the best of 3 alternating runs
    for _ in range(3):
        for product in best:
            start = time.perf_counter()
            product(x, weight, None)
            best[product] = min(best[product], time.perf_counter() - start)
    chosen = min(best, key=best.get)
    log.info("CPU products of many %s rows: %s (%.2fx the other here)", dtype, chosen.__name__,
             max(best.values()) / best[chosen])
    return chosen


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:   # one fused kernel
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # half precision: normalize in float32 like the reference implementations
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))
    if cfg.rope_freq_factors is not None:      # as llama.cpp applies a GGUF's rope_freqs: θ_i / factor_i
        inv_freq = inv_freq / torch.tensor(cfg.rope_freq_factors, dtype=torch.float64)
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        is_medium = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        freqs = torch.outer(torch.arange(cfg.max_position_embeddings, dtype=torch.float64), rope_inv_freq(cfg))
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos().float(), persistent=False)
        self.register_buffer("sin", emb.sin().float(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for each position, shaped [T, 1, D] to broadcast over heads."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, D] in the Hugging Face rotate_half layout."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.scale = cfg.head_dim ** -0.5

    def forward(self, x, rope: tuple[torch.Tensor, torch.Tensor], k_cache, v_cache, meta: AttentionMetadata):
        t = x.shape[0]
        qk, v = self.qkv_proj(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = qk.reshape(t, self.num_heads + self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            qk = torch.cat([self.q_norm(qk[:, :self.num_heads]), self.k_norm(qk[:, self.num_heads:])], dim=1)
        q, k = apply_rope(qk, *rope).split([self.num_heads, self.num_kv_heads], dim=1)
        o = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)
        return self.o_proj(o.reshape(t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, rope, k_cache, v_cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), rope, k_cache, v_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


def fuse_projections(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint names → decoder names: q/k/v into qkv_proj, gate/up into gate_up_proj."""
    fused = dict(weights)
    groups = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
              "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
    for name in weights:
        for target, parts in groups.items():
            for kind in ("weight", "bias"):
                if name.endswith(f"{parts[0]}.{kind}"):
                    prefix = name[: -len(f"{parts[0]}.{kind}")]
                    keys = [f"{prefix}{p}.{kind}" for p in parts]
                    fused[f"{prefix}{target}.{kind}"] = torch.cat([weights[k] for k in keys])
                    for k in keys:
                        del fused[k]
    return fused


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Decoder(nn.Module):
    """forward(token_ids [T], kv_cache, meta) → hidden [T, hidden]; logits(hidden) → [N, vocab] float32.

    kv_cache: [2, num_layers, num_slots, num_kv_heads, head_dim] (the pool's storage).
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.rope = RotaryEmbedding(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def from_weights(cls, cfg: ModelConfig, weights: dict[str, torch.Tensor],
                     dtype: torch.dtype, device: torch.device) -> "Decoder":
        """Build on the meta device, then adopt the checkpoint tensors (no random init, no copy twice)."""
        with torch.device("meta"):
            model = cls(cfg)
        weights = fuse_projections(weights)
        expected = set(model.state_dict())
        if cfg.tie_word_embeddings:
            weights = {k: v for k, v in weights.items() if k != "lm_head.weight"}
            expected.discard("lm_head.weight")
        missing, unexpected = expected - set(weights), set(weights) - expected
        if missing or unexpected:
            raise ValueError(f"checkpoint does not match the {cfg.architecture} decoder: "
                             f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
        model.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in weights.items()},
                              strict=False, assign=True)
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        with torch.device(device):
            model.rope = RotaryEmbedding(cfg)
        return model.eval()

    def forward(self, token_ids: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.model.embed_tokens(token_ids)
        rope = self.rope(meta.positions, x.dtype)
        for i, layer in enumerate(self.model.layers):
            meta.layer = i
            x = layer(x, rope, kv_cache[0, i], kv_cache[1, i], meta)
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()
