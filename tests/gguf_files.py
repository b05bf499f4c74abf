"""Synthetic GGUF files written the way llama.cpp's converter writes them (weights and config, no tokenizer)."""
from __future__ import annotations

import re

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize

from kvtier.models import ggml


def quantized_bytes(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """The gguf package's blocks where it quantizes the type, ggml's otherwise (the K-quants)."""
    try:
        return quantize(data, qtype)
    except NotImplementedError:
        return ggml.quantize(torch.from_numpy(data), int(qtype)).numpy()


GGUF_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
              "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_name(hf_name: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf_name in top:
        return top[hf_name]
    layer, module, kind = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", hf_name).groups()
    return f"blk.{layer}.{GGUF_NAMES[module]}.{kind}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # convert_hf_to_gguf.py, LlamaModel.permute
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def head_dim(hf_cfg) -> int:
    return getattr(hf_cfg, "head_dim", None) or hf_cfg.hidden_size // hf_cfg.num_attention_heads


def write_gguf(path, arch: str, hf_cfg, weights: dict[str, torch.Tensor], qtypes: dict[str, GGMLQuantizationType],
               extra: dict[str, np.ndarray] | None = None):
    """Write weights the way llama.cpp's converter does (and `extra` tensors under their GGUF names); returns what
    loading must give back."""
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(hf_cfg.num_hidden_layers)
    writer.add_context_length(hf_cfg.max_position_embeddings)
    writer.add_embedding_length(hf_cfg.hidden_size)
    writer.add_feed_forward_length(hf_cfg.intermediate_size)
    writer.add_head_count(hf_cfg.num_attention_heads)
    writer.add_head_count_kv(hf_cfg.num_key_value_heads)
    writer.add_key_length(head_dim(hf_cfg))
    writer.add_rope_freq_base(1e6)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_eos_token_id(2)
    expected = {}
    for name, w in weights.items():
        data = w.numpy()
        if arch == "llama" and ".q_proj." in name:
            data = llama_cpp_permute(data, hf_cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            data = llama_cpp_permute(data, hf_cfg.num_key_value_heads)
        # matrices in their given types, vectors (norms, biases) in F32 as llama.cpp's converter keeps them
        qtype = qtypes.get(name.rsplit(".", 2)[-2], GGMLQuantizationType.F32) if w.dim() == 2 else \
            GGMLQuantizationType.F32
        if qtype == GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name(name), data)
        else:
            blocks = quantized_bytes(data, qtype)
            writer.add_tensor(gguf_name(name), blocks, raw_dtype=qtype)
            # the rounding loading reproduces (rows back in Hugging Face's order)
            w = torch.from_numpy(dequantize(quantized_bytes(w.numpy(), qtype), qtype))
        expected[name] = w
    for name, data in (extra or {}).items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected
