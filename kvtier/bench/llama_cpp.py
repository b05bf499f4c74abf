"""llama.cpp on the same GGUF file, for the benchmarks' llama.cpp column: ik_llama.cpp (a fork with faster CPU
kernels) through the prebuilt `ik-llama-cpp-python` wheel, when it is installed (nothing here compiles it).

Prefill is one prompt run in llama.cpp's micro-batches with the last token's logits; decode is greedy (argmax of
each sequence's logits, read back as kvtier reads its own) over as many sequences as given, in one batch per step.
Both batches are cut to the most rows whose products compute what one row at a time does (`max_rows`).
`Products` are matrix products through the wheel's own ggml, for `kvtier bench kernels`' column of its kernels.
"""
from __future__ import annotations

import ctypes
import functools
import os
import time
import weakref

import numpy as np
import torch

from kvtier.models.ggml import _InitParams     # struct ggml_init_params: the same in both ggml builds

PROBE_TOKENS = 128      # a prompt run a row at a time and in batches, to find the batches that compute the same
AGREE = 0.05            # their last logits' largest difference over the largest logit, at most


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
        self.max_rows, self.disagreement = self._exact_rows()

    def _exact_rows(self) -> tuple[int, tuple[int, float, float] | None]:
        """The most rows llama.cpp's products may take at once and still compute what one row at a time computes
        (to AGREE of the largest logit), and where fewer had to be taken, the rows of the last batch that did not
        (its rows, the logits' largest difference, the largest logit). The wheel's Q4_1 product of 32 rows or
        more is wrong where a row is 576 wide (SmolLM2's: 0.32-0.40 of the largest output apart from float32's
        product, against 0.07-0.09 at fewer rows and at widths of 512, 640, 768 and 1536; the bundled model's
        96-token prompt as one batch gave logits up to 17.4 apart from a row at a time, the largest 24.6, and
        another argmax): a prefill or a decode batch that fast computes something else. Micro-batches and decode
        batches are cut to it. Batches are tried halving from the probe's length (its micro-batch where that is
        shorter): where the probe agrees as one batch, its whole micro-batch is taken, untried past the probe."""
        probe = [(1000 + i) % self.vocab for i in range(PROBE_TOKENS)]
        want = self._last_logits(probe, 1)
        whole = self.context._n_ubatch
        rows, apart = min(whole, PROBE_TOKENS), None
        while rows > 1:
            got = self._last_logits(probe, rows)
            difference, largest = float(np.abs(got - want).max()), float(np.abs(want).max())
            if difference <= AGREE * largest:
                return (whole if apart is None else rows), apart
            rows, apart = rows // 2, (rows, difference, largest)
        return 1, apart

    def _last_logits(self, tokens: list[int], rows: int) -> np.ndarray:
        """The last token's logits after tokens run in an empty cache, `rows` at a time."""
        self.context.kv_cache_clear()
        self._run(tokens, 0, rows)
        return self._logits(-1).copy()

    @property
    def rows_note(self) -> str:
        """What the text beside its numbers says of the rows its batches were cut to ('' where none were)."""
        if self.disagreement is None:
            return ""
        rows, difference, largest = self.disagreement
        return (f" On this file the wheel's products of {rows} rows at once computed other logits than "
                f"one row at a time (up to {difference:.1f} apart, the largest {largest:.1f}), so its micro-batches "
                f"and decode batches take {self.max_rows} rows at most.")

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

    def _logits(self, row: int) -> np.ndarray:
        """Row `row`'s logits of the last batch decoded (-1: its last), in llama.cpp's memory."""
        return np.ctypeslib.as_array(self.api.llama_get_logits_ith(self.context.ctx, row), shape=(self.vocab,))

    def _argmax(self, row: int) -> int:
        return int(self._logits(row).argmax())

    def prefill(self, prompt: list[int]) -> float:
        """Seconds to the first token of a prompt, in an empty cache."""
        return self.turn([], prompt)

    def turn(self, cached: list[int], new: list[int]) -> float:
        """Seconds to the first token of `new` tokens after `cached` ones already in its cache (computed first,
        untimed), as llama.cpp's server answers a turn whose prefix it kept (a prompt it holds whole: its last token
        again)."""
        self.context.kv_cache_clear()
        self._run(cached, 0, self.max_rows)
        start = time.perf_counter()
        self._run(new, len(cached), self.max_rows)
        self._argmax(-1)
        return time.perf_counter() - start

    def _run(self, tokens: list[int], first: int, step: int, seq: int = 0) -> None:
        """tokens at positions first.. of sequence seq, `step` at a time (llama.cpp's micro-batches, or fewer),
        logits for the last one."""
        for a in range(0, len(tokens), step):
            chunk = tokens[a:a + step]
            last = a + step >= len(tokens)
            self._decode(chunk, list(range(first + a, first + a + len(chunk))), [seq] * len(chunk),
                         [last and i == len(chunk) - 1 for i in range(len(chunk))])

    def decode(self, prompts: list[list[int]], num_tokens: int) -> float:
        """Tokens/s of greedy decoding of every prompt at once, after each prompt's first token."""
        self.context.kv_cache_clear()
        nexts = []
        for seq, prompt in enumerate(prompts):
            self._run(prompt, 0, self.max_rows, seq)
            nexts.append(self._argmax(-1))
        seqs, length, most = list(range(len(prompts))), len(prompts[0]), self.max_rows
        start = time.perf_counter()
        for step in range(num_tokens - 1):
            for a in range(0, len(seqs), most):      # one batch, or several of max_rows
                group = seqs[a:a + most]
                self._decode(nexts[a:a + most], [length + step] * len(group), group, [True] * len(group))
                nexts[a:a + most] = [self._argmax(i) for i in range(len(group))]
        return len(prompts) * (num_tokens - 1) / (time.perf_counter() - start)


class _Plan(ctypes.Structure):      # struct ggml_cplan, as the wheel's ggml lays it out
    _fields_ = [("work_size", ctypes.c_size_t), ("work_data", ctypes.c_void_p), ("n_threads", ctypes.c_int),
                ("abort_callback", ctypes.c_void_p), ("abort_callback_data", ctypes.c_void_p)]


@functools.cache
def _ggml() -> ctypes.CDLL:
    """The wheel's ggml (the same build its llama.cpp links, loaded again), its symbols kept to itself: kvtier's own
    ggml (libggml-python's) is another library."""
    import ik_llama_cpp
    path = os.path.join(os.path.dirname(ik_llama_cpp.__file__), "lib", "libggml.so")
    g = ctypes.CDLL(path, mode=os.RTLD_LOCAL | os.RTLD_NOW | os.RTLD_DEEPBIND)
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    for name, restype, argtypes in [
            ("ggml_init", p, [_InitParams]), ("ggml_free", None, [p]), ("ggml_tensor_overhead", ctypes.c_size_t, []),
            ("ggml_graph_overhead", ctypes.c_size_t, []), ("ggml_row_size", ctypes.c_size_t, [ctypes.c_int, i64]),
            ("ggml_new_tensor_2d", p, [p, ctypes.c_int, i64, i64]), ("ggml_get_data", p, [p]),
            ("ggml_quantize_chunk", ctypes.c_size_t, [ctypes.c_int, p, p, i64, i64, i64, p]),
            ("ggml_mul_mat", p, [p, p, p]), ("ggml_new_graph", p, [p]), ("ggml_build_forward_expand", None, [p, p]),
            ("ggml_graph_plan", _Plan, [p, ctypes.c_int]), ("ggml_graph_compute", ctypes.c_int, [p, p])]:
        f = getattr(g, name)
        f.restype, f.argtypes = restype, argtypes
    return g


class _Context:
    """A context of the wheel's ggml with `size` bytes of its own memory, freed with this object (what the products'
    calls hold: a Products dropped while its calls live keeps it)."""

    def __init__(self, size: int):
        g = self.g = _ggml()
        self.ptr = g.ggml_init(_InitParams(size, None, False))
        if not self.ptr:
            raise MemoryError("ik_llama.cpp's ggml gave no context")
        weakref.finalize(self, g.ggml_free, self.ptr)

    def floats(self, tensor: int, rows: int, size: int) -> torch.Tensor:
        """A float32 tensor's memory [rows, size], as torch's."""
        memory = (ctypes.c_float * (rows * size)).from_address(self.g.ggml_get_data(tensor))
        return torch.from_numpy(np.ctypeslib.as_array(memory)).view(rows, size)


def _compute(context: _Context, graph: int, plan: _Plan, work: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One product's graph, over the work memory its plan points at (held here, with the context)."""
    if context.g.ggml_graph_compute(graph, ctypes.byref(plan)) != 0:
        raise RuntimeError("ik_llama.cpp's ggml failed a product")
    return y


class Products:
    """y = x @ W.T through ik_llama.cpp's kernels, for each of several weights W [out, in] (float32) quantized to
    `ggml_type` by the wheel's ggml, x [rows, in] float32 shared: `calls[i]()` computes weight i's product as
    llama.cpp computes a graph (on `threads` threads, planned once) and returns its y. `x` and the y's are the
    context's own memory, reused call after call. One context holds them all: that ggml keeps 64 contexts at most."""

    def __init__(self, weights: list[torch.Tensor], ggml_type: int, rows: int, threads: int):
        g = _ggml()
        out_features, in_features = weights[0].shape
        self.nbytes = g.ggml_row_size(ggml_type, in_features) * out_features      # one weight's
        objects = 1 + 3 * len(weights)      # x, and each weight's blocks, product and graph
        size = (objects * (g.ggml_tensor_overhead() + 64)      # 64: room for ggml's alignment of each object
                + len(weights) * (g.ggml_graph_overhead() + self.nbytes + 4 * rows * out_features)
                + 4 * rows * in_features)
        self._context = context = _Context(size)
        x = g.ggml_new_tensor_2d(context.ptr, 0, in_features, rows)       # GGML_TYPE_F32
        self.x = context.floats(x, rows, in_features)
        self.calls = []
        for weight in weights:
            w = g.ggml_new_tensor_2d(context.ptr, ggml_type, in_features, out_features)
            source = weight.float().contiguous()
            g.ggml_quantize_chunk(ggml_type, source.data_ptr(), g.ggml_get_data(w), 0, out_features, in_features,
                                  None)
            y = g.ggml_mul_mat(context.ptr, w, x)
            graph = g.ggml_new_graph(context.ptr)
            g.ggml_build_forward_expand(graph, y)
            plan = g.ggml_graph_plan(graph, threads)
            work = torch.empty(max(1, plan.work_size), dtype=torch.uint8)
            plan.work_data = work.data_ptr()
            self.calls.append(functools.partial(_compute, context, graph, plan, work,
                                                context.floats(y, rows, out_features)))
