"""Every Triton kernel of kvtier compiled for CUDA targets, without a GPU: Triton's compiler and the ptxas its wheel
ships turn each kernel into a cubin for a target named here. Each wrapper (the functions the decoder calls) runs on
small CPU tensors with its launches recorded instead of run; each launch is then compiled as a GPU would compile
it: argument types from the values given, constexprs and launch options as given. In Triton's interpreter (how the
other tests run the kernels on CPU) a kernel that would not compile can still compute the right numbers.

    python tests/triton_compile.py [--quick]     # Triton's interpreter off

compiles for sm_80 and sm_90 (A100, H100/H200) in each dtype served on CUDA, products of 1 and 3 rows (--quick:
sm_90 in bfloat16, 1 row, what the test suite runs), as Triton's launcher specializes each launch there, with its
shared memory checked against the target's; prints one line per kernel and signature, and exits non-zero if any
failed.
"""
from __future__ import annotations

import os
import sys

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("run with Triton's interpreter off (TRITON_INTERPRET unset): @triton.jit gives interpreted functions")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

from kvtier.models import ggml, triton_attention, triton_fused, triton_int4pack, triton_quantized  # noqa: E402
from kvtier.models.packed import PACKED_TYPES, pack  # noqa: E402

SHARED_BYTES = {80: 166912, 90: 232448}      # the most shared memory a block may use: A100, H100 / H200
SERVED = (torch.bfloat16, torch.float16, torch.float32)     # --dtype on CUDA; float32 where the CUDA suite runs it


def recorded_launches(calls) -> list[tuple[JITFunction, tuple, dict]]:
    """(kernel, args, kwargs) of every launch `calls()` makes, none of them run."""
    launches = []
    run = JITFunction.run
    JITFunction.run = lambda self, *args, grid, warmup, **kwargs: launches.append((self, args, kwargs))
    try:
        calls()
    finally:
        JITFunction.run = run
    return launches


def compiled(kernel: JITFunction, args: tuple, kwargs: dict, capability: int) -> str:
    """The launch compiled for sm_<capability> as Triton's launcher would compile it there (its own specialization:
    pointer and integer alignment, integers equal to 1 made constant), its shared memory checked against the
    target's; a description of its signature."""
    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    bind = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = bind(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound, specialization, options)
    made = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=target, options=options.__dict__)
    if made.metadata.shared > SHARED_BYTES[capability]:
        raise ValueError(f"{made.metadata.shared} bytes of shared memory, more than sm_{capability}'s "
                         f"{SHARED_BYTES[capability]}")
    shown = {kernel.params[path[0]].name: value for path, value in constexprs.items() if value is not None}
    return f"{kernel.fn.__name__} {shown} {sorted(set(signature.values()) - {'constexpr'})}"


def quantized_calls(dtypes: tuple[torch.dtype, ...], rows: tuple[int, ...]) -> None:
    n, k = 64, 256
    for kind in PACKED_TYPES:
        blocks = ggml.quantize(torch.randn(n, k), int(kind))
        for dtype in dtypes:
            w = pack(blocks, int(kind), k, torch.device("cpu"), dtype)
            for m in rows:
                triton_quantized.product(torch.randn(m, k, dtype=dtype), w)
            triton_quantized.dequantize(w, torch.tensor([0, 5]))


def int4pack_calls(dtypes: tuple[torch.dtype, ...], rows: tuple[int, ...]) -> None:
    n, k = 2 * triton_int4pack.NT * 8, 2 * triton_int4pack.K_OUTER
    packed = torch.zeros(n // 8, k // triton_int4pack.K_OUTER, 32, triton_int4pack.INNER_K_TILES // 2,
                         dtype=torch.int32)
    for dtype in dtypes:
        scales_and_zeros = torch.zeros(k // triton_int4pack.GROUP, n, 2, dtype=dtype)
        for m in rows:
            triton_int4pack.product(packed, scales_and_zeros, triton_int4pack.GROUP, torch.randn(m, k, dtype=dtype), 2)
        triton_int4pack.dequantize(packed, scales_and_zeros, triton_int4pack.GROUP, torch.tensor([0, 1]),
                                   torch.empty(2, k, dtype=dtype))


def fused_calls(dtypes: tuple[torch.dtype, ...], _) -> None:
    for dtype in dtypes:
        x = torch.randn(4, 2048, dtype=dtype)
        triton_fused.rms_norm(x, torch.ones(2048, dtype=dtype), 1e-6)
        triton_fused.silu_mul(x)
        q, table = torch.randn(4, 32, 128, dtype=dtype), torch.randn(4, 1, 128, dtype=dtype)
        triton_fused.rope(q, table, table)


def attention_calls(dtypes: tuple[torch.dtype, ...], _) -> None:
    heads, kv_heads, dim, block, slots = 32, 8, 128, 16, 256
    for dtype in dtypes:
        q, out = torch.randn(4, heads, dim, dtype=dtype), torch.empty(4, heads, dim, dtype=dtype)
        k_cache = v_cache = torch.randn(slots, kv_heads, dim, dtype=dtype)
        rows, lens = torch.arange(2, dtype=torch.int32), torch.tensor([40, 200], dtype=torch.int32)
        tables = torch.arange(2 * 13, dtype=torch.int32).view(2, 13)
        triton_attention.decode(q, k_cache, v_cache, out, rows, tables, lens, block, 0.1)
        triton_attention.decode(q, k_cache, v_cache, out, rows, tables, lens, block, 0.1, num_splits=4,
                                most_parts=4, part_tokens=64)
        starts, query_lens = torch.tensor([0, 2], dtype=torch.int32), torch.tensor([2, 2], dtype=torch.int32)
        triton_attention.prefill(q, k_cache, v_cache, out, starts, query_lens, lens - 2, tables, 2, block, 0.1)


def main(capabilities: tuple[int, ...], dtypes: tuple[torch.dtype, ...], rows: tuple[int, ...]) -> int:
    """rows: of the products' launches (1, a batch-1 decode, which Triton makes a constant)."""
    launches = recorded_launches(lambda: [calls(dtypes, rows) for calls in (quantized_calls, int4pack_calls,
                                                                             fused_calls, attention_calls)])
    failed, seen = 0, set()
    for kernel, args, kwargs in launches:
        for capability in capabilities:
            try:
                line = compiled(kernel, args, kwargs, capability)
            except Exception as e:       # a compile error of any kind: report it, go on with the others
                failed += 1
                print(f"FAILED sm_{capability} {kernel.fn.__name__} {kwargs}: {type(e).__name__}: {e}")
                continue
            if (capability, line) not in seen:
                seen.add((capability, line))
                print(f"sm_{capability} {line}")
    print(f"{len(launches)} launches, {len(seen)} distinct kernels compiled, {failed} failed")
    return 1 if failed or not launches else 0


if __name__ == "__main__":
    quick = sys.argv[1:] == ["--quick"]
    sys.exit(main((90,) if quick else (80, 90), (torch.bfloat16,) if quick else SERVED, (1,) if quick else (1, 3)))
