"""Model identity: the cache namespace covers every weight byte, so changed weights never hit old KV;
digests are remembered by path, size, inode, mtime and ctime so a restart does not rehash."""
import os
import shutil
import time

import pytest

from kvtier.config import Config
from kvtier.engine.engine import LLMEngine
from kvtier.engine.sampling_params import SamplingParams
from kvtier.models import digest
from kvtier.models.gguf_file import GGUFFile
from kvtier.models.loader import BUNDLED_MODEL


def test_digests_are_remembered_by_path_size_and_times(tmp_path, monkeypatch):
    weights, cache = tmp_path / "w.bin", tmp_path / "kv" / "fingerprints.json"
    weights.write_bytes(bytes(range(256)) * 1000)
    first = digest.file_digest(str(weights), str(cache))
    hashed = []
    monkeypatch.setattr(digest, "_hash_file", lambda path: hashed.append(path) or "rehashed")
    assert digest.file_digest(str(weights), str(cache)) == first and not hashed      # remembered
    data = bytearray(weights.read_bytes())
    data[200_000] ^= 1
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(1, 2))    # another mtime: hashed again
    assert digest.file_digest(str(weights), str(cache)) == "rehashed" and hashed == [str(weights)]
    hashed.clear()
    stat = os.stat(weights)
    other = tmp_path / "other.bin"          # another file put at the path, its size and times copied (`cp -p`)
    other.write_bytes(bytes(data[::-1]))
    os.utime(other, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    os.replace(other, weights)
    assert digest.file_digest(str(weights), str(cache)) == "rehashed" and hashed == [str(weights)]
    hashed.clear()
    stat = os.stat(weights)
    time.sleep(0.05)        # past the kernel's coarse clock tick, which file times are stamped with
    with open(weights, "r+b") as f:         # changed in place, its mtime put back: the change time tells
        f.write(b"\x01")
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert os.stat(weights).st_ino == stat.st_ino
    assert digest.file_digest(str(weights), str(cache)) == "rehashed" and hashed == [str(weights)]
    monkeypatch.undo()
    assert digest.file_digest(str(weights)) != first          # every byte counts
    cache.write_text("{not json")                            # a damaged cache is a miss
    assert digest.file_digest(str(weights), str(cache)) == digest.file_digest(str(weights))


def cached_tokens(engine, prompt) -> int:
    engine.add_request("r", prompt, SamplingParams(max_tokens=1, temperature=0))
    cached = None
    while engine.has_unfinished():
        for out in engine.step():
            cached = out.num_cached_tokens
    return cached


@pytest.mark.integration
def test_weights_changed_past_the_first_64_kib_of_a_tensor_never_hit_old_files(tmp_path):
    model = shutil.copy(BUNDLED_MODEL, tmp_path / "model.gguf")
    config = dict(kv_pool_tokens=2048, kv_disk_dir=str(tmp_path / "kv"), kv_host_gib=0.5, max_model_len=1024)
    prompt = [(31 * i) % 4000 + 100 for i in range(300)]
    engine = LLMEngine(Config(model=str(model), **config))
    assert cached_tokens(engine, prompt) == 0
    engine.shutdown()     # the saves reach the disk
    assert cached_tokens(LLMEngine(Config(model=str(model), **config)), prompt) == 299   # a restart hits
    tensor = max(GGUFFile(str(model)).tensors, key=lambda t: t.n_bytes)
    offset = int(tensor.data_offset) + 100_000     # well past the first 64 KiB of the largest tensor
    stat = os.stat(model)
    with open(model, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x11]))
    assert os.stat(model).st_size == stat.st_size
    changed = LLMEngine(Config(model=str(model), **config))
    assert changed.fingerprint != engine.fingerprint
    assert cached_tokens(changed, prompt) == 0
