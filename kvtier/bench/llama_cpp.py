"""llama.cpp on the same GGUF file, for the benchmarks' llama.cpp column: ik_llama.cpp (a fork with faster CPU
kernels) through the prebuilt `ik-llama-cpp-python` wheel, when it is installed (nothing here compiles it).

Prefill is one prompt run in llama.cpp's micro-batches with the last token's logits; decode is greedy (argmax of
each sequence's logits, read back as kvtier reads its own) over as many sequences as given, in one batch per step.
"""
from __future__ import annotations

import functools
import time

import numpy as np


def available() -> bool:
    try:
        import ik_llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def has_avx_vnni() -> bool:
    """Whether this CPU has AVX-VNNI: the wheel's own check, which reads py-cpuinfo's flags and says no where
    py-cpuinfo is missing (it is no dependency of the wheel), else the kernel's flags. Without it, llama.cpp ran with
    flash attention off on CPUs that have it: at 2048 tokens its prefill 0.7x as fast (a Xeon with AVX-VNNI)."""
    from ik_llama_cpp.llama import _cpu_has_avx_vnni
    if _cpu_has_avx_vnni():
        return True
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and "avx_vnni" in line.split() for line in f)
    except OSError:
        return False


class LlamaCpp:
    def __init__(self, path: str, threads: int, context: int, max_seqs: int):
        from ik_llama_cpp import _ctypes_api as api
        from ik_llama_cpp._internals import IkContext, IkModel
        self.api = api
        self.model = IkModel(path)
        # its flash attention asserts on long prompts without AVX-VNNI (the wheel's own guard)
        self.flash_attention = has_avx_vnni()
        self.context = IkContext(self.model, n_ctx=context, n_threads=threads, flash_attn=self.flash_attention,
                                 n_seq_max=max_seqs)
        self.vocab = api.llama_vocab_n_tokens(api.llama_model_get_vocab(self.model.model))

    def _decode(self, tokens: list[int], positions: list[int], seqs: list[int], logits: list[bool]) -> None:
        batch = self.api.llama_batch_init(len(tokens), 0, 1)
        batch.n_tokens = len(tokens)
        for i, (token, pos, seq, wanted) in enumerate(zip(tokens, positions, seqs, logits)):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, wanted
            batch.seq_id[i][0] = seq
        try:
            if self.context.decode(batch) != 0:
                raise RuntimeError("llama.cpp failed to decode a batch")
        finally:
            self.api.llama_batch_free(batch)

    def _argmax(self, row: int) -> int:
        logits = np.ctypeslib.as_array(self.api.llama_get_logits_ith(self.context.ctx, row), shape=(self.vocab,))
        return int(logits.argmax())

    def prefill(self, prompt: list[int]) -> float:
        """Seconds to the first token of a prompt, in an empty cache."""
        return self.turn([], prompt)

    def turn(self, cached: list[int], new: list[int]) -> float:
        """Seconds to the first token of `new` tokens after `cached` ones already in its cache (computed first,
        untimed), as llama.cpp's server answers a turn whose prefix it kept (a prompt it holds whole: its last token
        again)."""
        self.context.kv_cache_clear()
        self._run(cached, 0)
        start = time.perf_counter()
        self._run(new, len(cached))
        self._argmax(-1)
        return time.perf_counter() - start

    def _run(self, tokens: list[int], first: int) -> None:
        """tokens at positions first.. of sequence 0, in llama.cpp's micro-batches, logits for the last one."""
        step = self.context._n_ubatch
        for a in range(0, len(tokens), step):
            chunk = tokens[a:a + step]
            last = a + step >= len(tokens)
            self._decode(chunk, list(range(first + a, first + a + len(chunk))), [0] * len(chunk),
                         [last and i == len(chunk) - 1 for i in range(len(chunk))])

    def decode(self, prompts: list[list[int]], num_tokens: int) -> float:
        """Tokens/s of greedy decoding of every prompt at once, after each prompt's first token."""
        self.context.kv_cache_clear()
        nexts = []
        for seq, prompt in enumerate(prompts):
            self._decode(prompt, list(range(len(prompt))), [seq] * len(prompt),
                         [i == len(prompt) - 1 for i in range(len(prompt))])
            nexts.append(self._argmax(-1))
        seqs, length = list(range(len(prompts))), len(prompts[0])
        start = time.perf_counter()
        for step in range(num_tokens - 1):
            self._decode(nexts, [length + step] * len(seqs), seqs, [True] * len(seqs))
            nexts = [self._argmax(i) for i in seqs]
        return len(prompts) * (num_tokens - 1) / (time.perf_counter() - start)
