"""A GGUF's tokenizer is parsed once and saved under kvtier's cache directory, by the file's metadata: later loads
(of the file, a copy, or the file with other weights) read the saved files and behave the same; a damaged save is
parsed again."""
import os
import shutil

import numpy as np
from gguf import GGUFWriter

from kvtier.models import tokenizer as tokenizer_module
from kvtier.models.gguf_file import GGUFFile
from kvtier.models.loader import BUNDLED_MODEL
from kvtier.models.tokenizer import Tokenizer

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Héllo 🌍 <tool_call> 12\n\tx"}]


def fresh_load() -> Tokenizer:
    tokenizer_module._load_hf_tokenizer.cache_clear()
    return Tokenizer.load(BUNDLED_MODEL)


def test_the_saved_tokenizer_behaves_as_the_parsed_one(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    parsed = fresh_load()
    saved_dir = tokenizer_module._saved_tokenizer_dir(GGUFFile(BUNDLED_MODEL))
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


def test_a_copy_or_other_weights_find_the_saved_tokenizer_and_other_metadata_does_not(tmp_path):
    """Saved by the file's metadata: a copy, or the file with a weight byte changed, reads the same save."""
    copy = shutil.copy(BUNDLED_MODEL, tmp_path / "copy.gguf")
    tensor = GGUFFile(copy).tensors[-1]
    with open(copy, "r+b") as f:
        f.seek(tensor.data_offset)
        f.write(bytes([f.read(1)[0] ^ 0x11]))
    saved_dir = tokenizer_module._saved_tokenizer_dir
    assert saved_dir(GGUFFile(copy)) == saved_dir(GGUFFile(BUNDLED_MODEL))
    other = GGUFWriter(str(tmp_path / "other.gguf"), "llama")
    other.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    for write in (other.write_header_to_file, other.write_kv_data_to_file, other.write_tensors_to_file):
        write()
    other.close()
    assert saved_dir(GGUFFile(str(tmp_path / "other.gguf"))) != saved_dir(GGUFFile(BUNDLED_MODEL))
