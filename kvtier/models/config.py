"""Architecture hyper-parameters shared by the Llama, Qwen2 and Qwen3 families."""
from __future__ import annotations

from dataclasses import dataclass

ARCHITECTURES = ("llama", "qwen2", "qwen3")
ROPE_SCALINGS = ("default", "linear", "llama3")


@dataclass
class ModelConfig:
    architecture: str                 # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # HF "rope_scaling" / "rope_parameters" (llama3, linear), None → plain RoPE
    rope_freq_factors: tuple[float, ...] | None = None   # a GGUF's rope_freqs (Llama 3): each frequency divided by one
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False      # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False             # RMSNorm on q and k per head before RoPE (Qwen3)
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"unsupported architecture {self.architecture!r}; kvtier supports {ARCHITECTURES}")
        if not all(isinstance(n, int) for n in (self.num_layers, self.num_heads, self.num_kv_heads)):
            raise ValueError(f"layer and head counts must be single numbers, one for every layer (got "
                             f"{self.num_layers!r} layers, {self.num_heads!r} heads, {self.num_kv_heads!r} K/V heads)")
        if self.rope_kind not in ROPE_SCALINGS:
            raise ValueError(f"unsupported rope scaling type {self.rope_kind!r} "
                             f"(supported: {', '.join(ROPE_SCALINGS)})")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")

    @property
    def rope_kind(self) -> str:
        """The RoPE scaling's type (one of ROPE_SCALINGS)."""
        scaling = self.rope_scaling or {}
        return scaling.get("rope_type", scaling.get("type", "default"))
