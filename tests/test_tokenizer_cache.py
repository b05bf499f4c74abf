"""A GGUF's tokenizer is parsed once and saved under kvtier's cache directory: later loads read the saved
files and behave the same; a damaged save is parsed again."""
import os

from kvtier.models import tokenizer as tokenizer_module
from kvtier.models.loader import BUNDLED_MODEL
from kvtier.models.tokenizer import Tokenizer

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Héllo 🌍 <tool_call> 12\n\tx"}]


def fresh_load() -> Tokenizer:
    tokenizer_module._load_hf_tokenizer.cache_clear()
    return Tokenizer.load(BUNDLED_MODEL)


def test_the_saved_tokenizer_behaves_as_the_parsed_one(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    parsed = fresh_load()
    saved_dir = tokenizer_module._saved_tokenizer_dir(BUNDLED_MODEL)
    assert os.path.isfile(os.path.join(saved_dir, "tokenizer.json"))
    saved = fresh_load()
    text = "Once upon a time — ünïcode\n\n  spaces 🌍"
    assert saved.encode(text) == parsed.encode(text) and saved.decode(saved.encode(text)) == parsed.decode(
        parsed.encode(text))
    assert saved.apply_chat_template(MESSAGES) == parsed.apply_chat_template(MESSAGES)
    assert (saved.eos_token_ids, saved.vocab_size, saved.chat_template) == \
           (parsed.eos_token_ids, parsed.vocab_size, parsed.chat_template)
    with open(os.path.join(saved_dir, "tokenizer.json"), "w") as f:
        f.write("{damaged")
    assert fresh_load().apply_chat_template(MESSAGES) == parsed.apply_chat_template(MESSAGES)
    tokenizer_module._load_hf_tokenizer.cache_clear()
