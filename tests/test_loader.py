"""Model loading: the bundled GGUF against transformers, HF directories, synthetic GGUFs, bad input."""
from __future__ import annotations

import json
import os
import re
import shutil

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from kvtier.models.loader import BUNDLED_MODEL, hf_config, load_model, read_gguf, resolve_model_path
from kvtier.models.tokenizer import Tokenizer
from gguf_files import head_dim, write_gguf

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, max_position_embeddings=2048)


@pytest.fixture(scope="module")
def bundled():
    return load_model(BUNDLED_MODEL)


def assert_same_weights(weights: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], atol: float = 0.0):
    assert weights.keys() == ref.keys()
    for name, w in weights.items():
        assert w.shape == ref[name].shape, name
        assert (w.float() - ref[name].float()).abs().max() <= atol, name


# ---- the bundled model ----

def test_resolve_model_path(tmp_path):
    assert resolve_model_path(None) == BUNDLED_MODEL and os.path.isfile(BUNDLED_MODEL)
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)
    with pytest.raises(ValueError, match="never downloads.*--model"):
        resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct")


def test_bundled_config(bundled):
    c = bundled.config
    assert (c.architecture, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == ("llama", 30, 9, 3, 64)
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.max_position_embeddings) == (49152, 576, 1536, 8192)
    assert c.tie_word_embeddings and not c.attention_bias and not c.qk_norm
    assert c.rope_theta == 100000.0 and c.rope_scaling is None and c.eos_token_ids == (2,)
    assert bundled.name == "SmolLM2-135M-Instruct.Q4_1"
    assert re.fullmatch(r"[0-9a-f]{32}", bundled.fingerprint)


def test_bundled_weights_match_transformers(bundled, bundled_transformers):
    # transformers dequantizes and un-permutes the same file on its own
    ref = dict(bundled_transformers.state_dict())
    del ref["lm_head.weight"]  # tied to the embedding
    assert all(w.dtype == torch.float32 for w in bundled.weights.values())
    assert_same_weights(bundled.weights, ref, atol=1e-6)


def test_chat_template_ends_with_assistant_prompt(bundled_tokenizer):
    ids = bundled_tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2?"}])
    text = bundled_tokenizer.decode(ids, skip_special_tokens=False)
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_encode_decode_round_trip(bundled_tokenizer):
    text = "The quick brown fox, 1234 — naïve café ✓\n  indented"
    ids = bundled_tokenizer.encode(text)
    assert ids[0] != 1  # SmolLM2 adds no BOS to plain completions
    assert bundled_tokenizer.decode(ids) == text
    assert [bundled_tokenizer.token_str(i) for i in bundled_tokenizer.encode("Hello world")] == ["Hello", " world"]


def test_eos_and_vocab(bundled_tokenizer, bundled):
    assert 2 in bundled_tokenizer.eos_token_ids and 2 in bundled.tokenizer.eos_token_ids
    assert bundled_tokenizer.token_str(2) == "<|im_end|>"
    assert bundled_tokenizer.vocab_size == 49152


def test_missing_chat_template_raises(tiny_model_dir, tmp_path):
    shutil.copytree(tiny_model_dir, tmp_path, dirs_exist_ok=True)
    os.remove(tmp_path / "chat_template.jinja")
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer.load(str(tmp_path)).apply_chat_template([{"role": "user", "content": "hi"}])


# ---- Hugging Face directories ----

@pytest.mark.parametrize("config_cls, overrides, flags", [
    (LlamaConfig, {}, dict(attention_bias=False, qk_norm=False, tie_word_embeddings=False, head_dim=16)),
    (Qwen2Config, {"tie_word_embeddings": True}, dict(attention_bias=True, qk_norm=False, tie_word_embeddings=True)),
    (Qwen3Config, {"head_dim": 32}, dict(attention_bias=False, qk_norm=True, tie_word_embeddings=False, head_dim=32)),
])
def test_hf_dir_round_trip(make_tiny_model, bundled_tokenizer, config_cls, overrides, flags):
    path = make_tiny_model(config_cls(**TINY, vocab_size=bundled_tokenizer.vocab_size, **overrides))
    loaded = load_model(path)
    assert {k: getattr(loaded.config, k) for k in flags} == flags
    assert loaded.config.architecture == config_cls.model_type and loaded.name == os.path.basename(path)
    ref = AutoModelForCausalLM.from_pretrained(path).state_dict()
    if loaded.config.tie_word_embeddings:
        del ref["lm_head.weight"]
    assert_same_weights(loaded.weights, ref)
    assert all(w.dtype == torch.bfloat16 for w in load_model(path, torch.bfloat16).weights.values())


def test_hf_config_fields(tmp_path):
    # older transformers layout: rope_theta and rope_scaling at the top, eos lists, generation_config.json
    config = dict(model_type="llama", vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=1, rope_theta=500000.0, eos_token_id=[7, 8],
                  rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 1024})
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [8, 9]}))
    c = hf_config(str(tmp_path))
    assert (c.rope_theta, c.eos_token_ids, c.num_kv_heads, c.head_dim) == (500000.0, (7, 8, 9), 1, 16)
    assert c.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 1024}


def test_sharded_checkpoint(tiny_model_dir, bundled_tokenizer, tmp_path):
    AutoModelForCausalLM.from_pretrained(tiny_model_dir).save_pretrained(tmp_path, max_shard_size="5MB")
    bundled_tokenizer.hf.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert_same_weights(load_model(str(tmp_path)).weights, load_model(tiny_model_dir).weights)


def test_fingerprint(make_tiny_model, tiny_model_dir, tmp_path):
    first = load_model(tiny_model_dir).fingerprint
    assert load_model(tiny_model_dir).fingerprint == first
    moved = shutil.copytree(tiny_model_dir, tmp_path / "moved")
    assert load_model(str(moved)).fingerprint == first  # the path is not part of it
    other = make_tiny_model(LlamaConfig.from_pretrained(tiny_model_dir), seed=1)
    assert load_model(other).fingerprint != first
    # one changed weight in the middle of the model changes it too
    weights = load_file(moved / "model.safetensors")
    weights["model.layers.1.mlp.up_proj.weight"][0, 0] += 1.0
    save_file(weights, moved / "model.safetensors", metadata={"format": "pt"})
    assert load_model(str(moved)).fingerprint != first


# ---- synthetic GGUF files (weights and config only, no tokenizer) ----

QTYPES = {"embed_tokens": GGMLQuantizationType.Q8_0, "q_proj": GGMLQuantizationType.F16,
          "k_proj": GGMLQuantizationType.BF16, "o_proj": GGMLQuantizationType.Q4_0,
          "gate_proj": GGMLQuantizationType.Q4_1, "down_proj": GGMLQuantizationType.Q8_0}


@pytest.mark.parametrize("config_cls, overrides", [
    (LlamaConfig, {"tie_word_embeddings": False}),
    (Qwen2Config, {"tie_word_embeddings": True}),
    (Qwen3Config, {"head_dim": 32}),
])
def test_gguf_round_trip(tmp_path, config_cls, overrides):
    hf_cfg = config_cls(**TINY, vocab_size=256, **overrides)
    weights = {n: w.detach() for n, w in AutoModelForCausalLM.from_config(hf_cfg).state_dict().items()}
    if hf_cfg.tie_word_embeddings:
        del weights["lm_head.weight"]
    expected = write_gguf(tmp_path / "m.gguf", hf_cfg.model_type, hf_cfg, weights, QTYPES)
    config, loaded, _ = read_gguf(str(tmp_path / "m.gguf"), torch.float32)
    assert (config.architecture, config.head_dim, config.num_kv_heads, config.vocab_size) == (
        hf_cfg.model_type, head_dim(hf_cfg), 2, 256)
    assert config.tie_word_embeddings == hf_cfg.tie_word_embeddings
    assert (config.attention_bias, config.qk_norm) == (hf_cfg.model_type == "qwen2", hf_cfg.model_type == "qwen3")
    assert (config.rope_theta, config.eos_token_ids) == (1e6, (2,))
    assert_same_weights(loaded, expected)


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 256}


def llama3_rope_factors(hf_cfg) -> np.ndarray:
    """rope_freqs as llama.cpp's converter writes them for a Llama 3 checkpoint (LlamaModel.generate_extra_tensors)."""
    rope, dim = hf_cfg.rope_scaling, head_dim(hf_cfg)
    freqs = 1.0 / (1e6 ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    low_wavelen = rope["original_max_position_embeddings"] / rope["low_freq_factor"]
    high_wavelen = rope["original_max_position_embeddings"] / rope["high_freq_factor"]
    factors = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < high_wavelen:
            factors.append(1)
        elif wavelen > low_wavelen:
            factors.append(rope["factor"])
        else:
            smooth = (rope["original_max_position_embeddings"] / wavelen - rope["low_freq_factor"]) / (
                rope["high_freq_factor"] - rope["low_freq_factor"])
            factors.append(1 / ((1 - smooth) / rope["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


def test_a_llama3_gguf_applies_its_rope_factors_as_transformers_does(tmp_path):
    """A Llama 3 GGUF (its RoPE scaling written as rope_freqs, one factor per frequency) loads, and the rotary
    tables it gives equal transformers' for the checkpoint it came from."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from kvtier.models.decoder import RotaryEmbedding
    hf_cfg = LlamaConfig(**TINY, vocab_size=256, rope_theta=1e6, rope_scaling=LLAMA3_ROPE)
    weights = {n: w.detach() for n, w in AutoModelForCausalLM.from_config(hf_cfg).state_dict().items()}
    factors = llama3_rope_factors(hf_cfg)
    assert 1.0 < factors.max() and factors.min() == 1.0     # low frequencies scaled, high ones kept, some smoothed
    expected = write_gguf(tmp_path / "m.gguf", "llama", hf_cfg, weights, {}, extra={"rope_freqs.weight": factors})
    config, loaded, _ = read_gguf(str(tmp_path / "m.gguf"), torch.float32)
    assert_same_weights(loaded, expected)
    assert config.rope_freq_factors == pytest.approx(factors.tolist())
    positions = torch.tensor([0, 1, 37, 255, 256, 1000, 2047])
    cos, sin = RotaryEmbedding(config)(positions, torch.float32)
    want_cos, want_sin = LlamaRotaryEmbedding(hf_cfg)(torch.zeros(1), positions[None])
    assert torch.allclose(cos[:, 0], want_cos[0], atol=1e-5) and torch.allclose(sin[:, 0], want_sin[0], atol=1e-5)
    write_gguf(tmp_path / "plain.gguf", "llama", hf_cfg, weights, {})
    plain = read_gguf(str(tmp_path / "plain.gguf"), torch.float32)[0]
    assert not torch.allclose(RotaryEmbedding(plain)(positions, torch.float32)[0], cos)   # the factors matter


def test_rope_factors_of_the_wrong_count_are_refused(tmp_path):
    hf_cfg = LlamaConfig(**TINY, vocab_size=256)
    weights = {n: w.detach() for n, w in AutoModelForCausalLM.from_config(hf_cfg).state_dict().items()}
    write_gguf(tmp_path / "m.gguf", "llama", hf_cfg, weights, {}, extra={"rope_freqs.weight": np.ones(3, np.float32)})
    with pytest.raises(ValueError, match="rope_freqs holds 3 factors, not 8"):
        read_gguf(str(tmp_path / "m.gguf"), torch.float32)


# ---- bad input ----

def test_bad_hf_dirs(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="no model at"):
        load_model(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="no config.json"):
        load_model(str(tmp_path))
    with open(os.path.join(tiny_model_dir, "config.json")) as f:
        config = json.load(f)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(config | {"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(config | {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}))
    with pytest.raises(ValueError, match="config.json: unsupported rope scaling type 'yarn'"):
        load_model(str(tmp_path))       # named before any weight is read (this directory has none)
    (tmp_path / "config.json").write_text(json.dumps(config | {"num_key_value_heads": [1, 2]}))
    with pytest.raises(ValueError, match="config.json: layer and head counts must be single numbers"):
        load_model(str(tmp_path))
    shutil.copy(os.path.join(tiny_model_dir, "model.safetensors"), tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config | {"intermediate_size": 96}))
    with pytest.raises(ValueError, match=r"wrong shape \(6\): model.layers.0.mlp.gate_proj.weight"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="cannot load a tokenizer"):
        load_model(str(tmp_path))


def test_bad_gguf_files(tmp_path):
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_text("hello")
    with pytest.raises(ValueError, match="neither a directory nor a GGUF file"):
        load_model(str(not_gguf))
    hf_cfg = LlamaConfig(**TINY, vocab_size=256)
    weights = {n: w.detach() for n, w in AutoModelForCausalLM.from_config(hf_cfg).state_dict().items()}
    good = tmp_path / "good.gguf"
    write_gguf(good, "llama", hf_cfg, weights, {})
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(good.read_bytes()[:5000])
    with pytest.raises(ValueError, match="damaged"):
        read_gguf(str(truncated), torch.float32)
    write_gguf(tmp_path / "gpt2.gguf", "gpt2", hf_cfg, weights, {})
    with pytest.raises(ValueError, match="unsupported architecture 'gpt2'"):
        read_gguf(str(tmp_path / "gpt2.gguf"), torch.float32)
    f64 = tmp_path / "f64.gguf"
    write_gguf(f64, "llama", hf_cfg, {**weights, "model.norm.weight": weights["model.norm.weight"].double()}, {})
    for quantize in ("none", "stored"):      # an array of floats, never taken for ggml's blocks
        with pytest.raises(ValueError, match="quantization type F64"):
            read_gguf(str(f64), torch.float32, quantize=quantize)
