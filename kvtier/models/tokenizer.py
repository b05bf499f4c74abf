"""The model's tokenizer: text to token ids and back, the chat template, end-of-sequence ids."""
from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile

import jinja2
import tokenizers
import transformers
import xxhash
from transformers import AutoTokenizer

from kvtier.config import cache_home
from kvtier.models.gguf_file import GGUFFile


@functools.lru_cache(maxsize=4)
def _load_hf_tokenizer(path: str, mtime_ns: int):
    """Build a transformers tokenizer once per file version. A GGUF vocabulary takes seconds to parse
    (8.7 s for SmolLM2's on a 2-core machine), so the parsed tokenizer is also saved, in transformers'
    own files, under kvtier's cache directory, by the file's metadata."""
    try:
        if os.path.isdir(path):
            return AutoTokenizer.from_pretrained(path, local_files_only=True)
        header = GGUFFile(path)      # its metadata names the save, and the special tokens of a parse
        saved = _saved_tokenizer_dir(header)
        if os.path.isfile(os.path.join(saved, "tokenizer.json")):
            try:
                return AutoTokenizer.from_pretrained(saved, local_files_only=True)
            except Exception:   # damaged: parse the GGUF again, and save it anew
                shutil.rmtree(saved, ignore_errors=True)
        tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                  local_files_only=True)
        _special_tokens_from_gguf(tokenizer, header)
        _byte_level_tokens(tokenizer)
    except Exception as e:  # transformers raises OSError, ValueError, KeyError... for unusable files
        raise ValueError(f"cannot load a tokenizer from {path}: {e}") from e
    _save(tokenizer, saved)
    return tokenizer


def _special_tokens_from_gguf(tokenizer, header: GGUFFile) -> None:
    """The GGUF file's own metadata names its end and start tokens: transformers' conversion has named others in
    some versions (5.17 took SmolLM2's <|im_start|> for its end-of-sequence token)."""
    fields = header.fields
    for attr, key in (("eos_token", "tokenizer.ggml.eos_token_id"), ("bos_token", "tokenizer.ggml.bos_token_id")):
        if key in fields:
            setattr(tokenizer, attr, tokenizer.convert_ids_to_tokens(int(fields[key])))


def _byte_level_tokens(tokenizer) -> None:
    """Some versions of transformers' conversion (5.17) mark a GPT-2 style vocabulary (its pre-tokenizer byte-level)
    as falling back to bytes, with sentencepiece's decoders before the byte-level one: text decodes right, but
    llguidance then reads its tokens as text ("Ċ", not a newline) and a forced tool call breaks. Such a
    vocabulary's tokens are byte-level, and its model and decoder say so here."""
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    if (spec.get("pre_tokenizer") or {}).get("type") != "ByteLevel" or not spec["model"].get("byte_fallback"):
        return
    spec["model"]["byte_fallback"] = False
    spec["decoder"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
    tokenizer._tokenizer = tokenizers.Tokenizer.from_str(json.dumps(spec))


CONVERSION = 2       # kvtier's repairs of a converted tokenizer (2: byte-level tokens), so older saves are parsed anew


def _saved_tokenizer_dir(header: GGUFFile) -> str:
    """By the file's metadata (where its vocabulary lies: a copy of the file, or the same file with other weights,
    finds it), the transformers version that converted it and kvtier's repairs."""
    version = f"{header.metadata_digest()}:{transformers.__version__}:{CONVERSION}"
    return os.path.join(cache_home(), "tokenizers", xxhash.xxh3_64_hexdigest(version.encode()))


def _save(tokenizer, directory: str) -> None:
    """Save beside, then rename into place, so a reader never sees half a tokenizer."""
    try:
        os.makedirs(os.path.dirname(directory), exist_ok=True)
        staging = tempfile.mkdtemp(dir=os.path.dirname(directory))
        tokenizer.save_pretrained(staging)
        os.replace(staging, directory)
    except OSError:       # another process saved it first, or the cache is not writable: parse next time
        shutil.rmtree(staging, ignore_errors=True)


class Tokenizer:
    def __init__(self, hf_tokenizer, eos_token_ids=()):
        self.hf = hf_tokenizer
        eos = set(eos_token_ids)
        if hf_tokenizer.eos_token_id is not None:
            eos.add(hf_tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.vocab_size = len(hf_tokenizer)

    @classmethod
    def load(cls, path: str, eos_token_ids=()) -> Tokenizer:
        """From a Hugging Face directory or a GGUF file; eos_token_ids adds the model config's ids."""
        path = os.path.abspath(path)
        return cls(_load_hf_tokenizer(path, os.stat(path).st_mtime_ns), eos_token_ids)

    def encode(self, text: str) -> list[int]:
        # what vLLM does for /v1/completions: the tokenizer's own special tokens (BOS if it adds one)
        return self.hf(text).input_ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def chat_template(self) -> str | None:
        return self.hf.chat_template

    @functools.cached_property
    def added_tokens(self) -> frozenset[str]:
        """The texts of the tokens added to the vocabulary (`<|im_end|>`, `<think>`, `<tool_call>`...)."""
        return frozenset(token.content for token in self.hf.added_tokens_decoder.values())

    @property
    def knows_tools(self) -> bool:
        """Whether the chat template has a tool format of its own (it reads the `tools` variable)."""
        return "tools" in (self.chat_template or "")

    def use_chat_template(self, template: str) -> None:
        self.hf.chat_template = template

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None, **template_kwargs) -> list[int]:
        """The prompt's token ids; template_kwargs reach the template (e.g. enable_thinking)."""
        # render, then tokenize without adding special tokens: the template already wrote them
        return self.hf(self.render_chat(messages, tools, **template_kwargs), add_special_tokens=False).input_ids

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None, **template_kwargs) -> str:
        """The prompt's text, ending with the assistant's generation prompt."""
        if not self.hf.chat_template:
            raise ValueError("this model's tokenizer has no chat template; use /v1/completions with a plain prompt")
        try:
            return self.hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False,
                                               **template_kwargs)
        except jinja2.TemplateError as e:   # the template refused the conversation (e.g. roles must alternate)
            raise ValueError(f"the chat template rejected the messages: {e}") from e

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token stands for: a text of N characters is at least N / this tokens."""
        pieces = self.hf.convert_ids_to_tokens(list(range(self.vocab_size)))
        return max(len(piece) for piece in pieces if piece is not None)

    def token_str(self, token_id: int) -> str:
        return self.hf.decode([token_id], skip_special_tokens=False)
