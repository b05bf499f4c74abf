"""Random-weight models of real shapes, built offline from a config, for measuring speed where the real weights are
not at hand (nothing is downloaded): a Hugging Face directory that kvtier and transformers both load, with the
bundled model's tokenizer, or a GGUF file in a llama.cpp quantization mix (`GGUF_SHAPES`), with the bundled file's
tokenizer. Speed depends on the shapes, not on the values of the weights."""
from __future__ import annotations

import argparse
import json
import os

import torch

from kvtier.config import DTYPES, cache_home, default_dtype

LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
SHAPES = {
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, tie_word_embeddings=True,
                         rope_scaling={**LLAMA3_ROPE, "factor": 32.0}),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
                         rope_scaling={**LLAMA3_ROPE, "factor": 8.0}),
    # the 1B model's layout at a few MB, for the benchmark's own tests
    "tiny-llama3": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                        rope_scaling={**LLAMA3_ROPE, "factor": 32.0}),
}
# llama.cpp's Q4_K_M mix (Q6_K for the V and down projections and the output) and its Q4_0 mix (Q6_K for the
# output), with the bundled tokenizer's 49152-token vocabulary: a 7B-class model at Mistral 7B's shape (about 4.3 GB
# in Q4_K_M), and Llama 3.2 1B's (about 0.8 GB)
Q4_K_M = {"token_embd": "Q4_K", "attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K",
          "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q6_K", "output": "Q6_K"}
Q4_0 = dict.fromkeys(Q4_K_M, "Q4_0") | {"output": "Q6_K"}
MISTRAL_7B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=8)
LLAMA_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8)
GGUF_SHAPES = {"mistral-7b-q4_k_m": (MISTRAL_7B, Q4_K_M), "llama-3.2-1b-q4_k_m": (LLAMA_1B, Q4_K_M),
               "mistral-7b-q4_0": (MISTRAL_7B, Q4_0), "llama-3.2-1b-q4_0": (LLAMA_1B, Q4_0)}
COMMON = dict(vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
              bos_token_id=128000, eos_token_id=128001)


def build(shape: str, directory: str, dtype: torch.dtype, device: str) -> str:
    """Write the shape's random-weight model under directory (reused when already there); returns its path."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from kvtier.models.loader import BUNDLED_MODEL
    from kvtier.models.tokenizer import Tokenizer
    path = os.path.join(directory, f"{shape}-{str(dtype).removeprefix('torch.')}")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    config = LlamaConfig(**COMMON, **SHAPES[shape])
    with torch.device(device), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    staging = path + ".partial"
    model.save_pretrained(staging)
    Tokenizer.load(BUNDLED_MODEL).hf.save_pretrained(staging)
    with open(os.path.join(staging, "config.json")) as f:     # the tokenizer's ids above are its own
        saved = json.load(f)
    saved.update(eos_token_id=COMMON["eos_token_id"], bos_token_id=COMMON["bos_token_id"])
    with open(os.path.join(staging, "config.json"), "w") as f:
        json.dump(saved, f)
    os.replace(staging, path)
    return path


def build_gguf(shape: str, directory: str) -> str:
    """Write the shape's GGUF (reused when already there): each matrix's blocks quantized once per type and shape
    and written for every layer; returns its path."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

    from kvtier.models import ggml
    from kvtier.models.loader import BUNDLED_MODEL
    path = os.path.join(directory, f"{shape}.gguf")
    if os.path.isfile(path):
        return path
    cfg, types = GGUF_SHAPES[shape]
    h, ff, heads, kv_heads = (cfg[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                               "num_key_value_heads"))
    tokenizer = GGUFReader(BUNDLED_MODEL)
    vocab = len(tokenizer.fields["tokenizer.ggml.tokens"].contents())
    os.makedirs(directory, exist_ok=True)
    writer = GGUFWriter(path + ".partial", "llama")
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(32768)
    writer.add_embedding_length(h)
    writer.add_feed_forward_length(ff)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(1e6)
    writer.add_layer_norm_rms_eps(1e-5)
    for name, field in tokenizer.fields.items():
        if name.startswith("tokenizer."):
            array = field.types[0] == GGUFValueType.ARRAY
            writer.add_key_value(name, field.contents(), field.types[0], field.types[-1] if array else None)
    gen = torch.Generator().manual_seed(0)
    blocks = {}

    def matrix(kind: str, rows: int, cols: int) -> np.ndarray:
        key = (types[kind], rows, cols)
        if key not in blocks:
            weight = torch.randn(rows, cols, generator=gen) * cols ** -0.5
            blocks[key] = ggml.quantize(weight, int(GGMLQuantizationType[types[kind]])).numpy()
        return blocks[key]

    def add(name: str, kind: str, rows: int, cols: int) -> None:
        writer.add_tensor(name, matrix(kind, rows, cols), raw_dtype=GGMLQuantizationType[types[kind]])
    ones = np.ones(h, dtype=np.float32)
    add("token_embd.weight", "token_embd", vocab, h)
    add("output.weight", "output", vocab, h)
    writer.add_tensor("output_norm.weight", ones)
    d = h // heads
    for i in range(cfg["num_hidden_layers"]):
        for kind, rows, cols in (("attn_q", h, h), ("attn_k", kv_heads * d, h), ("attn_v", kv_heads * d, h),
                                 ("attn_output", h, h), ("ffn_gate", ff, h), ("ffn_up", ff, h), ("ffn_down", h, ff)):
            add(f"blk.{i}.{kind}.weight", kind, rows, cols)
        writer.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(path + ".partial", path)
    return path


def add_model_args(p: argparse.ArgumentParser) -> None:
    """--model, or --shape (and where its models are built)."""
    p.add_argument("--model", default=None, help="HF directory or .gguf file (default: the bundled SmolLM2-135M)")
    p.add_argument("--shape", choices=sorted(SHAPES | GGUF_SHAPES), help="a random-weight model of this shape, "
                                                                         "built offline (instead of --model)")
    p.add_argument("--shapes-dir", default=os.path.join(cache_home(), "shapes"), help="where --shape models are built")


def resolve_model(args: argparse.Namespace) -> None:
    """Point args.model at the --shape model, built in --dtype (the server's default for --device when not given)."""
    if args.shape in GGUF_SHAPES:
        args.model = build_gguf(args.shape, args.shapes_dir)
    elif args.shape:
        args.model = build(args.shape, args.shapes_dir, DTYPES[args.dtype or default_dtype(args.device)], args.device)
