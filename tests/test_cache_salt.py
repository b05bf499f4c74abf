"""Tenant isolation: a request's cache salt enters its block keys, so differently salted requests never
share KV, on the device or in a tier, while requests of one salt still do."""
import pytest

from kvtier.config import Config
from kvtier.engine.engine import LLMEngine
from kvtier.engine.sampling_params import SamplingParams
from kvtier.kv.keys import chain_keys, namespace, salt_root

BS = 16
PROMPT = [(19 * i) % 900 + 20 for i in range(100)]


def cached_tokens(engine, request_id, cache_salt, prompt=PROMPT) -> tuple[int, list[int]]:
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                       cache_salt=cache_salt)
    cached, tokens = None, []
    while engine.has_unfinished():
        for out in engine.step():
            cached, tokens = out.num_cached_tokens, tokens + out.new_token_ids
    return cached, tokens


def test_salted_keys_never_meet():
    ns = namespace("w", "float32", BS, "layout")
    plain, a, b = (chain_keys(PROMPT, BS, ns, salt_root(s)) for s in (None, "tenant-a", "tenant-b"))
    assert not set(plain) & set(a) and not set(a) & set(b)
    assert chain_keys(PROMPT, BS, ns, salt_root("tenant-a")) == a


@pytest.mark.parametrize("tier", ["device", "host"])
def test_only_the_same_salt_hits(tiny_model_dir, tier):
    engine = LLMEngine(Config(model=tiny_model_dir, block_size=BS, kv_pool_tokens=40 * BS, max_batched_tokens=64,
                              kv_host_gib=0.01 if tier == "host" else 0, kv_disk=False,
                              prefix_cache=tier == "device"))
    first = cached_tokens(engine, "a1", "tenant-a")
    assert first[0] == 0
    assert cached_tokens(engine, "b1", "tenant-b")[0] == 0        # another tenant learns nothing
    assert cached_tokens(engine, "n1", None)[0] == 0              # nor does an unsalted request
    again = cached_tokens(engine, "a2", "tenant-a")
    assert again[0] == 99 and again[1] == first[1]                # the same tenant reuses its prefix
    assert cached_tokens(engine, "n2", None)[0] == 99             # and so do unsalted requests, among themselves
