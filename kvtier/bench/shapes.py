"""Random-weight models of real shapes, built offline from a config, for measuring speed where the real weights are
not at hand (nothing is downloaded): a Hugging Face directory that kvtier and transformers both load, with the
bundled model's tokenizer. Speed depends on the shapes, not on the values of the weights."""
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


def add_model_args(p: argparse.ArgumentParser) -> None:
    """--model, or --shape (and where its models are built)."""
    p.add_argument("--model", default=None, help="HF directory or .gguf file (default: the bundled SmolLM2-135M)")
    p.add_argument("--shape", choices=sorted(SHAPES), help="a random-weight model of this shape, built offline "
                                                           "(instead of --model)")
    p.add_argument("--shapes-dir", default=os.path.join(cache_home(), "shapes"), help="where --shape models are built")


def resolve_model(args: argparse.Namespace) -> None:
    """Point args.model at the --shape model, built in --dtype (the server's default for --device when not given)."""
    if args.shape:
        args.model = build(args.shape, args.shapes_dir, DTYPES[args.dtype or default_dtype(args.device)], args.device)
