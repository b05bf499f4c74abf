"""One validated configuration for the engine and the server."""
from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass, field

import torch

from kvtier.spec.ngram import LOOKUP_MAX, LOOKUP_MIN

KV_POLICIES = ("lru", "quest", "meankey")
TOOL_CALL_PARSERS = ("hermes", "llama3_json")
REASONING_PARSERS = ("qwen3", "deepseek_r1")
EXACT_BLOCK_SIZE = 64       # tokens per block: large runs for the tiers
BOUNDED_BLOCK_SIZE = 16     # under bounded residency: pages small enough that a needle is not diluted in hay
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_dtype(device: str) -> str:
    return "bfloat16" if str(device).startswith("cuda") else "float32"


def cache_home() -> str:
    """kvtier's directory under the user's cache directory ($XDG_CACHE_HOME, else ~/.cache)."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "kvtier")


def default_disk_dir() -> str:
    return os.path.join(cache_home(), "kv")


QUANTIZE_MODES = ("auto", "none", "int8", "int4")
KV_CACHE_DTYPES = ("auto", "float32", "float16")
SPECULATIVE_METHODS = ("ngram", "draft", "dflash")


class ConfigError(ValueError):
    """A configuration value is out of range or inconsistent."""


# vLLM's --speculative-config: its keys kvtier honours → Config's fields, and its methods → kvtier's
SPECULATIVE_CONFIG_KEYS = {"method": "speculative", "model": "draft_model",
                           "num_speculative_tokens": "num_speculative_tokens",
                           "prompt_lookup_min": "prompt_lookup_min", "prompt_lookup_max": "prompt_lookup_max"}
SPECULATIVE_CONFIG_METHODS = {"ngram": "ngram", "draft_model": "draft", "dflash": "dflash"}
SPECULATIVE_CONFIG_TEXTS = ("method", "model")      # its keys whose values are strings; the others are integers


def speculative_config(text: str) -> dict:
    """vLLM's `--speculative-config` JSON (`{"method": "ngram", "num_speculative_tokens": 5}`) as Config's fields.
    A key kvtier has no counterpart for, or a method it does not have, is an error that names it."""
    try:
        given = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--speculative-config is not JSON: {e}") from None
    if not isinstance(given, dict):
        raise ConfigError('--speculative-config must be a JSON object, such as {"method": "ngram"}')
    unknown = sorted(set(given) - set(SPECULATIVE_CONFIG_KEYS))
    if unknown:
        raise ConfigError(f"--speculative-config: kvtier has no {', '.join(unknown)} (it takes "
                          f"{', '.join(SPECULATIVE_CONFIG_KEYS)})")
    for key, value in given.items():
        kind, name = (str, "a string") if key in SPECULATIVE_CONFIG_TEXTS else (int, "an integer")
        if type(value) is not kind:
            raise ConfigError(f"--speculative-config: {key} must be {name}, got {value!r}")
    if "method" in given and given["method"] not in SPECULATIVE_CONFIG_METHODS:
        raise ConfigError(f"--speculative-config: kvtier has no method {given['method']!r} (it has "
                          f"{', '.join(SPECULATIVE_CONFIG_METHODS)})")
    fields = {SPECULATIVE_CONFIG_KEYS[key]: value for key, value in given.items()}
    if "speculative" in fields:
        fields["speculative"] = SPECULATIVE_CONFIG_METHODS[fields["speculative"]]
    return fields


@dataclass
class Config:
    model: str | None = None              # HF directory or GGUF file; None → bundled SmolLM2
    device: str = field(default_factory=lambda: os.environ.get("KVTIER_DEVICE", "cpu"))
    # None → $KVTIER_DTYPE, else bfloat16 on CUDA and float32 on CPU
    dtype: str | None = field(default_factory=lambda: os.environ.get("KVTIER_DTYPE"))
    # weights: auto (a GGUF's quantized tensors kept as they are, on CPU in float32 and on CUDA with Triton, and on
    # CPU its and a checkpoint's 16-bit matrices too: `weights_mode`), none (every weight in dtype), int8 | int4
    # (every projection quantized at load: Q8_0 / Q4_0 blocks of 32)
    quantize: str = "auto"
    # the KV pool's dtype (named as vLLM's option): auto keeps the model's; float16, for a float32 model on CPU, halves
    # what the pool and the tiers take and what ggml's decode steps read of a context, as llama.cpp's default cache
    kv_cache_dtype: str = "auto"
    block_size: int | None = None         # None → 64, or 16 under bounded residency
    kv_pool_tokens: int | None = None     # None → a share of available device memory (pool.default_pool_tokens)
    # on CUDA, the fraction of the device's memory this engine's weights and pool may take (vLLM's option; several
    # servers on one GPU); None → $KVTIER_GPU_MEMORY_UTILIZATION, else no fraction (the pool takes a share of what is
    # free after the weights)
    gpu_memory_utilization: float | None = field(
        default_factory=lambda: os.environ.get("KVTIER_GPU_MEMORY_UTILIZATION"))
    max_batched_tokens: int = 2048        # per-step token budget (prefill chunks + decodes)
    max_num_seqs: int = 64                # sequences running at once
    # a step carrying prompt tokens beside running decodes takes at most this many decode-only steps' time; 0: no bound
    max_itl_ratio: float = 2.0
    max_model_len: int | None = None      # None → the model's context length
    num_threads: int | None = None        # torch CPU threads; None → torch's default
    enforce_eager: bool = False           # on CUDA, no decode graphs: every step launches its kernels
    # ngram: decoding sequences propose tokens by prompt lookup; draft: a draft model decodes them; dflash: a DFlash
    # block drafter proposes them from the model's hidden features; None: off
    speculative: str | None = None
    draft_model: str | None = None        # the draft model (a smaller one, the same tokenizer) or DFlash drafter
    # the most tokens a sequence proposes for one step (llama.cpp's --draft-max): each sequence adapts its own to
    # what pays, so a long copy runs in long drafts; on a 2-core CPU 16 made editing 2.02x (median of 7 runs)
    # against 8's 1.92x (of 5; docs/BENCHMARKS.md)
    num_speculative_tokens: int = 16
    prompt_lookup_min: int = LOOKUP_MIN   # ngram: the shortest ending of a sequence looked up in its context
    prompt_lookup_max: int = LOOKUP_MAX   # and the longest (the longest that occurred before proposes)
    prefix_cache: bool = True             # reuse cached blocks of earlier requests' prefixes
    # host RAM tier budget; 0 disables it. $KVTIER_KV_HOST_GIB sets the default (the suite on a GPU: every
    # engine pins its host tier, and eight workers each hold several engines)
    kv_host_gib: float = field(default_factory=lambda: os.environ.get("KVTIER_KV_HOST_GIB", 4.0))
    kv_disk: bool = True                  # the local disk tier
    kv_disk_dir: str = field(default_factory=lambda: default_disk_dir())
    kv_disk_gib: float = 20.0
    # bounded residency: at most this many of a sequence's tokens are resident; None → exact attention
    kv_resident_tokens: int | None = None
    kv_sink_blocks: int = 1               # first blocks, always resident
    kv_tail_blocks: int = 4               # last blocks, always resident
    kv_policy: str = "meankey"            # how the other resident blocks are chosen
    kv_reselect_every: int = 16           # decode tokens between reselections
    # server
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_names: list[str] = field(default_factory=list)   # names clients may ask for; [] → the model's
    any_model_name: bool = False          # answer to any model name (as llama.cpp does), e.g. an agent's second model
    api_keys: list[str] = field(default_factory=list)   # any of them opens every route but /health
    api_key_file: str | None = None       # more keys, one per line ('#' starts a comment)
    cache_salt_from_api_key: bool = False  # each key's requests share KV only with the same key's
    max_request_bytes: int = 16 * 2**20   # larger bodies get a 413 before they are read
    sse_keepalive: float = 15.0           # seconds a stream waits silent before it answers / sends a comment
    chat_template: str | None = None      # a Jinja chat template file, instead of the model's
    tool_call_parser: str | None = None   # hermes | llama3_json; None → chosen from the chat template
    reasoning_parser: str | None = None   # qwen3 | deepseek_r1 | none; None → chosen from the chat template

    def __post_init__(self):
        if self.dtype is None:
            self.dtype = default_dtype(self.device)
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        try:
            device = torch.device(self.device)
        except RuntimeError as e:
            raise ConfigError(f"invalid device {self.device!r}: {e}") from None
        if device.type not in ("cpu", "cuda"):
            raise ConfigError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"device {self.device!r} requested but CUDA is not available")
        if self.quantize not in QUANTIZE_MODES:
            raise ConfigError(f"quantize must be one of {', '.join(QUANTIZE_MODES)}, got {self.quantize!r}")
        if self.quantize in ("int8", "int4") and not self._quantized_kernels(device):
            raise ConfigError(f"--quantize {self.quantize} runs on CPU in float32 (ggml's kernels) or on CUDA "
                              "with Triton installed (kvtier's kernels), with libggml-python installed")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                              f"{self.kv_cache_dtype!r}")
        if self.kv_dtype != self.dtype and (device.type == "cuda" or self.dtype != "float32"):
            raise ConfigError(f"--kv-cache-dtype {self.kv_cache_dtype} keeps a float32 model's cache in 16 bits on "
                              f"CPU; with --dtype {self.dtype} on {device.type} the cache keeps the model's dtype "
                              "(--kv-cache-dtype auto)")
        if self.speculative is not None and self.speculative not in SPECULATIVE_METHODS:
            raise ConfigError(f"speculative must be one of {', '.join(SPECULATIVE_METHODS)}, got "
                              f"{self.speculative!r}")
        if (self.speculative in ("draft", "dflash")) != (self.draft_model is not None):
            raise ConfigError("--speculative draft or dflash and --draft-model PATH go together: the draft model "
                              "or the DFlash drafter proposes the tokens")
        if self.draft_model is not None and not os.path.exists(os.path.expanduser(self.draft_model)):
            raise ConfigError(f"draft model path {self.draft_model!r} does not exist: point --draft-model at a local "
                              "Hugging Face directory or a .gguf file")
        if self.num_speculative_tokens < 1:
            raise ConfigError(f"num_speculative_tokens must be at least 1, got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError(f"prompt lookup needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                              f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.block_size is None:
            self.block_size = EXACT_BLOCK_SIZE if self.kv_resident_tokens is None else BOUNDED_BLOCK_SIZE
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        if self.kv_pool_tokens is not None and self.kv_pool_tokens < self.block_size:
            raise ConfigError(f"kv_pool_tokens must be at least one block ({self.block_size}), "
                              f"got {self.kv_pool_tokens}")
        if self.gpu_memory_utilization is not None:
            self._check_utilization()
        if self.max_batched_tokens < 1:
            raise ConfigError(f"max_batched_tokens must be positive, got {self.max_batched_tokens}")
        self.kv_host_gib = self._number("kv_host_gib")
        if self.kv_host_gib < 0 or self.kv_disk_gib < 0:
            raise ConfigError("kv_host_gib and kv_disk_gib must be >= 0")
        if self.kv_resident_tokens is not None:
            self._check_residency()
        if self.max_itl_ratio != 0 and self.max_itl_ratio <= 1:
            raise ConfigError(f"max_itl_ratio must be above 1 (or 0 for no bound), got {self.max_itl_ratio}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        self._check_server()
        if self.model is not None and "/" in self.model and not os.path.exists(self.model):
            # an id like "org/name" that is not a local path: we never download
            raise ConfigError(
                f"model {self.model!r} is not a local path and kvtier never downloads weights. "
                "Point --model at a local Hugging Face directory (config.json, *.safetensors, tokenizer files) "
                "or at a .gguf file, or leave --model out to use the bundled SmolLM2-135M-Instruct."
            )
        if self.model is not None and not os.path.exists(self.model):
            raise ConfigError(
                f"model path {self.model!r} does not exist. Point --model at a local Hugging Face directory "
                "or a .gguf file, or leave it out to use the bundled SmolLM2-135M-Instruct."
            )

    def _check_server(self) -> None:
        if self.api_key_file is not None:
            try:
                with open(self.api_key_file) as f:
                    lines = [line.split("#", 1)[0].strip() for line in f]
            except (OSError, UnicodeDecodeError) as e:
                raise ConfigError(f"cannot read api_key_file {self.api_key_file!r}: {e}") from None
            if not any(lines):
                raise ConfigError(f"api_key_file {self.api_key_file!r} holds no key")
            self.api_keys = [*self.api_keys, *filter(None, lines)]
            self.api_key_file = None
        if any(not key or key != key.strip() for key in self.api_keys):
            raise ConfigError("an API key must be non-empty and carry no surrounding whitespace")
        if self.cache_salt_from_api_key and not self.api_keys:
            raise ConfigError("cache_salt_from_api_key needs API keys (--api-key, --api-key-file or $KVTIER_API_KEY)")
        if self.tool_call_parser not in (None, *TOOL_CALL_PARSERS):
            raise ConfigError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                              f"got {self.tool_call_parser!r}")
        if self.reasoning_parser not in (None, "none", *REASONING_PARSERS):
            raise ConfigError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)} or none, "
                              f"got {self.reasoning_parser!r}")
        if any(not name or name != name.strip() for name in self.served_model_names):
            raise ConfigError("a served model name must be non-empty and carry no surrounding whitespace")
        if self.chat_template is not None and not os.path.isfile(self.chat_template):
            raise ConfigError(f"chat_template {self.chat_template!r} is not a file")
        if self.sse_keepalive <= 0:
            raise ConfigError(f"sse_keepalive must be positive, got {self.sse_keepalive}")
        if self.max_request_bytes < 1024:
            raise ConfigError(f"max_request_bytes must be at least 1024, got {self.max_request_bytes}")

    def _number(self, name: str) -> float:
        """A field's value as a number (its $KVTIER_* default comes as text), or a ConfigError that names it."""
        value = getattr(self, name)
        try:
            return float(value)
        except ValueError:
            raise ConfigError(f"{name} must be a number, got {value!r}") from None

    def _check_utilization(self) -> None:
        """A fraction in (0, 1]."""
        self.gpu_memory_utilization = self._number("gpu_memory_utilization")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")

    def _check_residency(self) -> None:
        if self.kv_policy not in KV_POLICIES:
            raise ConfigError(f"kv_policy must be one of {', '.join(KV_POLICIES)}, got {self.kv_policy!r}")
        if self.kv_sink_blocks < 0 or self.kv_tail_blocks < 1 or self.kv_reselect_every < 1:
            raise ConfigError("kv_sink_blocks must be >= 0, kv_tail_blocks and kv_reselect_every >= 1")
        least = (self.kv_sink_blocks + self.kv_tail_blocks + 1) * self.block_size
        if self.kv_resident_tokens < least:
            raise ConfigError(
                f"kv_resident_tokens={self.kv_resident_tokens} leaves no room for a scored block: it must be at least "
                f"(sink {self.kv_sink_blocks} + tail {self.kv_tail_blocks} + 1 blocks) × {self.block_size} = {least}")
        if self.kv_host_gib <= 0:
            raise ConfigError("kv_resident_tokens pages blocks out to the host tier: kv_host_gib must be > 0")

    @property
    def resident_blocks(self) -> int | None:
        return None if self.kv_resident_tokens is None else self.kv_resident_tokens // self.block_size

    def weights_mode(self, model_path: str) -> str:
        """What load_model is asked to do with the weights: quantize resolved for this model file, device and dtype.
        "stored" keeps a GGUF's blocks where kernels multiply them (CPU in float32, CUDA with Triton; on CUDA the
        types without a kernel are dequantized at load), and on CPU a GGUF's and a checkpoint's 16-bit matrices too,
        which float32 would double (on CUDA they take --dtype)."""
        if self.quantize != "auto":
            return self.quantize
        device = torch.device(self.device)
        kept = os.path.isfile(model_path) or device.type == "cpu"
        return "stored" if kept and self._quantized_kernels(device) else "none"

    def _quantized_kernels(self, device: torch.device) -> bool:
        """Whether kernels that multiply quantized weights run here: ggml's on CPU (float32 activations), kvtier's
        Triton ones on CUDA (ggml quantizes and dequantizes there at load)."""
        from kvtier.models import ggml
        if device.type == "cpu":
            return self.dtype == "float32" and ggml.available()
        return ggml.available() and importlib.util.find_spec("triton") is not None

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def kv_dtype(self) -> str:
        """The KV pool's dtype: --kv-cache-dtype, else the model's."""
        return self.dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        return DTYPES[self.kv_dtype]

    @property
    def dtypes(self) -> str:
        """The model's dtype, and the KV cache's where it differs: as reports name them."""
        return self.dtype if self.kv_dtype == self.dtype else f"{self.dtype}, KV cache {self.kv_dtype}"

    @property
    def kv_namespace_dtype(self) -> str:
        """The dtypes a KV namespace names: the model's, and the pool's where it differs (its blocks are no other
        pool's)."""
        return self.dtype if self.kv_dtype == self.dtype else f"{self.dtype},kv={self.kv_dtype}"
