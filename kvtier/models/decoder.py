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

import torch
import torch.nn.functional as F
from torch import nn

from kvtier.models.attention import AttentionMetadata, paged_attention, triton_module
from kvtier.models.config import ModelConfig
from kvtier.models.products import Linear
from kvtier.models.int4pack import TINYGEMM_TYPES, Int4PackWeight, choose_decode_products, int4packed
from kvtier.models.packed import pack, packable
from kvtier.models.quantized import (QuantizedEmbedding, QuantizedLinear, QuantizedWeight, concatenated, decoding,
                                     in_blocks, weight_prompt_dtype)
from kvtier.models.repacked import repacked

log = logging.getLogger("kvtier.models")


def fused_for(x: torch.Tensor):
    """The fused elementwise kernels (triton_fused.py) for x's device: on CUDA one kernel where eager ops launch
    several; on CPU, or without Triton, none."""
    return triton_module("triton_fused") if x.is_cuda else None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (fused := fused_for(x)) is not None:
            return fused.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:   # one fused kernel
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # half precision: normalize in float32 like the reference implementations
        return self.weight * F.rms_norm(x.float(), self.weight.shape, eps=self.eps).to(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))
    if cfg.rope_freq_factors is not None:      # as llama.cpp applies a GGUF's rope_freqs: θ_i / factor_i
        inv_freq = inv_freq / torch.tensor(cfg.rope_freq_factors, dtype=torch.float64)
    scaling = cfg.rope_scaling or {}
    if cfg.rope_kind == "default":
        return inv_freq
    if cfg.rope_kind == "linear":
        return inv_freq / scaling["factor"]
    # llama3 (ModelConfig allows no other)
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    is_medium = (wavelen <= old_len / low) & (wavelen >= old_len / high)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, cfg: ModelConfig, positions: int = 0):
        """Tables for the model's context, or for `positions` where that is more (a --max-model-len past it)."""
        super().__init__()
        # computed on the CPU, then moved where modules are being built: on the meta device (Decoder.from_weights)
        # arange would import torch's decompositions, ~2 s of every start
        with torch.device("cpu"):
            length = max(positions, cfg.max_position_embeddings)
            freqs = torch.outer(torch.arange(length, dtype=torch.float64), rope_inv_freq(cfg))
            emb = torch.cat([freqs, freqs], dim=-1)
        device = torch.get_default_device()
        self.register_buffer("cos", emb.cos().float().to(device), persistent=False)
        self.register_buffer("sin", emb.sin().float().to(device), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for each position, shaped [T, 1, D] to broadcast over heads."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, D] in the Hugging Face rotate_half layout."""
    if (fused := fused_for(x)) is not None:
        return fused.rope(x, cos, sin)
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
        gate_up = self.gate_up_proj(x)
        if (fused := fused_for(gate_up)) is not None:
            return self.down_proj(fused.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
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


def fuse_projections(weights: dict) -> None:
    """Checkpoint names → decoder names, in place: q/k/v into qkv_proj, gate/up into gate_up_proj, each group's parts
    gone once their fused copy is made. Quantized weights become lists of parts (one part where their block types
    agree)."""
    groups = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
              "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
    for name in list(weights):
        for target, parts in groups.items():
            for kind in ("weight", "bias"):
                if name.endswith(f"{parts[0]}.{kind}"):
                    prefix = name[: -len(f"{parts[0]}.{kind}")]
                    keys = [f"{prefix}{p}.{kind}" for p in parts]
                    weights[f"{prefix}{target}.{kind}"] = _stacked([weights.pop(k) for k in keys])


def _stacked(values: list) -> torch.Tensor | list[QuantizedWeight]:
    if all(isinstance(v, QuantizedWeight) for v in values):
        return concatenated(values)
    # float and quantized parts in one projection (rare): all of it in float
    return torch.cat([v.dequantized() if isinstance(v, QuantizedWeight) else v for v in values])


def packs_weights(device: torch.device) -> bool:
    """Whether the decoder packs quantized weights for Triton's kernels on this device (ggml's blocks on CPU)."""
    return device.type != "cpu"


def _kernel_ready(name: str, weight, dtype: torch.dtype):
    """A weight as the packed kernels take it: blocks of a type they multiply as they are, other blocks
    dequantized; so is an untied LM head outside tinygemm's types: on an H100 the Triton kernels read Q8_0 at
    220-245 GB/s, cuBLAS bfloat16 at 1.2-2.2 TB/s (a Llama 3 head: 2.5 ms a token against 0.5), for about one more
    byte per weight of one matrix."""
    if not isinstance(weight, QuantizedWeight):
        return weight
    if not in_blocks(weight.ggml_type):      # a GGUF's 16-bit float matrix: cuBLAS's, in dtype
        return weight.dequantized().to(dtype)
    if name == "lm_head.weight" and weight.ggml_type not in TINYGEMM_TYPES:
        log.info("%s: %s blocks dequantized to %s, which cuBLAS reads faster", name, weight.type_name, dtype)
    elif packable(weight.ggml_type):
        return weight
    else:
        log.info("%s: no GPU kernel multiplies %s blocks; dequantized to %s", name, weight.type_name, dtype)
    return weight.dequantized().to(dtype)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # built without a random init (the checkpoint's weights replace it): normal_ on the meta device imports
        # torch's reference ops, ~3 s of every start
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Decoder(nn.Module):
    """forward(token_ids [T], caches, meta) → hidden [T, hidden]; logits(hidden) → [N, vocab] float32.

    caches: the pool's (k_cache, v_cache), [num_layers, num_slots, num_kv_heads, head_dim] each.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.rope = RotaryEmbedding(cfg)
        # int4 weights on CUDA: per shape, the decode rows' product and each candidate's seconds, as chosen at load
        self.decode_products: dict[tuple[int, int], tuple[str, dict[str, float]]] = {}
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def from_weights(cls, cfg: ModelConfig, weights: dict, dtype: torch.dtype, device: torch.device,
                     packed: bool | None = None, positions: int = 0) -> "Decoder":
        """Build on the meta device, then adopt the checkpoint tensors (no random init, no copy twice). Quantized
        weights replace their modules with quantized ones: ggml's blocks on CPU (float32 activations; Q4_0 and Q4_1
        projections interleaved as ggml's faster kernels want them: repacked.py), packed for Triton's kernels
        elsewhere (packed=True takes those on CPU too, in Triton's interpreter: how the tests check them). There, a
        block type no kernel multiplies (and a GGUF's F16 / BF16 matrix) is dequantized to dtype, and so is an
        untied LM head outside tinygemm's types (`_kernel_ready`).

        positions: how many RoPE covers, where that is more than the model's context (`RotaryEmbedding`).

        Takes the tensors out of `weights` as it goes (left empty, unless a ValueError stops it): a weight's loaded
        copy is dropped once its fused, repacked or packed copy is made, so loading holds about one copy of the
        weights, not three."""
        packed = packs_weights(device) if packed is None else packed
        if packed:
            for k, v in weights.items():
                weights[k] = _kernel_ready(k, v, dtype)
        with torch.device("meta"):
            model = cls(cfg)
        fuse_projections(weights)
        expected = set(model.state_dict())
        if cfg.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
            expected.discard("lm_head.weight")
        missing, unexpected = expected - set(weights), set(weights) - expected
        if missing or unexpected:
            raise ValueError(f"checkpoint does not match the {cfg.architecture} decoder: "
                             f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}")
        quantized = {k.removesuffix(".weight"): v if isinstance(v, list) else [v] for k, v in weights.items()
                     if isinstance(v, (list, QuantizedWeight))}
        if quantized and not packed and dtype != torch.float32:
            raise ValueError("quantized weights run on CPU in float32 only")
        floats = {k: weights.pop(k).to(device=device, dtype=dtype) for k in list(weights)
                  if k.rsplit(".", 1)[0] not in quantized}
        model.load_state_dict(floats, strict=False, assign=True)
        for name in list(quantized):
            parts = quantized.pop(name)
            del weights[f"{name}.weight"]
            if packed:
                parts = [pack(p.blocks, p.ggml_type, p.in_features, device, dtype) for p in parts]
                if name != "model.embed_tokens":
                    parts = [int4packed(p) for p in parts]     # Q4_0 / Q4_1 for tinygemm, where it takes them
            elif name != "model.embed_tokens":      # an embedding takes rows, never products
                parts = [repacked(p) for p in parts]
            bias = weights.pop(f"{name}.bias", None)
            module = QuantizedEmbedding(parts[0]) if name == "model.embed_tokens" else \
                QuantizedLinear(parts, None if bias is None else bias.to(device=device, dtype=dtype))
            model.set_submodule(name, module)
        if packed and device.type == "cuda":
            model.decode_products = choose_decode_products([p for m in model.modules()
                                                            if isinstance(m, QuantizedLinear)
                                                            for p in m.parts if isinstance(p, Int4PackWeight)])
            torch.cuda.empty_cache()    # packing's and the choice's temporaries: memory the KV pool is sized from
        if cfg.tie_word_embeddings:
            embedding = model.model.embed_tokens
            if isinstance(embedding, QuantizedEmbedding):
                model.lm_head = QuantizedLinear([embedding.weight], None)
            else:
                model.lm_head.weight = embedding.weight
        with torch.device(device):
            model.rope = RotaryEmbedding(cfg, positions)
        return model.eval()

    @functools.cached_property
    def prompt_attention_dtype(self) -> torch.dtype | None:
        """The dtype prompt chunks attend in on CPU (None: the activations' own), but for prompts with few tokens past
        what the cache held (the runner's `_attention_dtype`): bfloat16 where the layers' quantized
        projections multiply prompt rows in it (`weight_prompt_dtype`; not a GGUF's F16 matrices, whose prompt rows
        keep float32), as the rows are rounded to it for their products after attention anyway (but for a bounded
        sequence's last prompt token, whose products are precise: runner.py). torch's flash attention in
        bfloat16 takes AMX or AVX512-BF16: a cold 4,096-token prompt of the bundled model on a 2-core Xeon 0.64-0.66x
        the time, 2,048 tokens 0.75-0.89x, 256 new tokens after a cached 2,048 0.72x (docs/BENCHMARKS.md). Fixed at
        load: the K/V of a prompt depend on it (the weights' fingerprint names it)."""
        dtypes = {weight_prompt_dtype(p.ggml_type, torch.float32) for layer in self.model.layers
                  for m in layer.modules() if isinstance(m, QuantizedLinear) for p in m.parts}
        return dtypes.pop() if len(dtypes) == 1 and torch.float32 not in dtypes else None

    @functools.cached_property
    def quantized(self) -> bool:
        """Whether any projection keeps quantized blocks (fixed at load; the runner asks every step)."""
        return any(isinstance(m, QuantizedLinear) for m in self.modules())

    def forward(self, token_ids: torch.Tensor, caches: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata
                ) -> torch.Tensor:
        decode_rows = torch.zeros(len(token_ids), dtype=torch.bool)
        decode_rows[meta.generated_rows] = True
        last = None
        if meta.last_prompt_rows:
            last = torch.zeros(len(token_ids), dtype=torch.bool)
            last[meta.last_prompt_rows] = True
        with decoding(decode_rows, last):      # how quantized weights multiply each row (quantized.py)
            x = self.model.embed_tokens(token_ids)
            rope = self.rope(meta.positions, x.dtype)
            for i, layer in enumerate(self.model.layers):
                meta.layer = i
                x = layer(x, rope, caches[0][i], caches[1][i], meta)
                if i in meta.feature_layers:
                    meta.features[i] = x
            x = self.model.norm(x)
            if len(self.model.layers) - 1 in meta.feature_layers:      # as transformers hands the last one: normed
                meta.features[len(self.model.layers) - 1] = x
            return x

    def logits(self, hidden: torch.Tensor, last: torch.Tensor | None = None) -> torch.Tensor:
        """[rows, vocab] in float32. last (bool [rows]): the rows of a prompt's last token (`decoding`); the others
        are decode rows to the LM head. Quantized weights multiply either through their blocks, never dequantizing
        the whole head for a row."""
        decode = torch.ones(len(hidden), dtype=torch.bool) if last is None else ~last
        with decoding(decode, last):
            return self.lm_head(hidden).float()
