"""Matrix products for quantized weights, measured side by side, at the bundled model's and a 7B model's shapes, for 1
and 8 rows:
- on CPU: torch's float32 and bfloat16 `F.linear`, torch's int8 weight-only kernel, and ggml's kernels over GGUF's
  own blocks (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K) through the prebuilt libggml-python wheel, and over Q4_0 and Q4_K blocks
  in ggml's CPU_REPACK layout (rows interleaved for its multi-row kernels) where this CPU has one, and Q4_1 and Q4_K
  blocks dequantized for torch's float32 and bfloat16 products (what prompt rows take); beside them, where the
  ik-llama-cpp-python wheel is installed, ik_llama.cpp's kernels over the same types (no dependency of kvtier's: what
  the benchmarks' llama.cpp column runs). kvtier takes the repacked layout for Q4_0 (models/repacked.py: the only
  copy, prompt rows getting the file's blocks back a slice at a time); Q4_K keeps the file's layout, since its
  repacked product rounds a row differently by how many rows share it, which speculation's verify steps and batches
  must not see;
- on CUDA (--device cuda), rows in bfloat16: cuBLAS over bfloat16 weights, kvtier's Triton kernels over packed GGUF
  blocks (every packed type), the same blocks dequantized for cuBLAS (what prompt rows of the other types take),
  and Q4_0 / Q4_1 in torch's int4 layout for its tinygemm kernel (`_weight_int4pack_mm`: what kvtier runs for their
  decode rows; their prompt rows take rows dequantized from that layout for cuBLAS, also measured), and kvtier's
  split-K Triton product over that layout (triton_int4pack.product), a candidate for those decode rows.

Each candidate cycles through enough copies of its weight that they do not stay in the caches, as a model's layers
do not: the time is a product's as served, reading its weight from memory.

    python -m kvtier.bench.kernels [--device cuda] [--shapes 576x1536,...,4096x14336] [--rows 1,8] [--no-write]
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kvtier.bench import llama_cpp
from kvtier.bench.report import add_output_args, cpu_model, header, int_list, name_list, parse_command, publish
from kvtier.models import ggml, triton_int4pack
from kvtier.models.choice import timed
from kvtier.models.int4pack import TINYGEMM, Int4PackWeight, int4packed
from kvtier.models.packed import PACKED_TYPES, pack
from kvtier.models.quantized import QuantizedWeight, dequantized_product

SECTION = "## CPU matrix products for quantized weights"
CUDA_SECTION = "## CUDA matrix products for quantized weights"
DENSE = "dense (cuBLAS)"         # F.linear over the weight in the rows' dtype
GGML_TYPES = {"q8_0": 8, "q4_0": 2, "q4_1": 3, "q4_k": 12, "q6_k": 14}     # GGUF's numbering
K_QUANTS = ("q4_k", "q6_k")      # blocks of 256 columns
REPACKED = ("q4_0", "q4_k")      # ggml's CPU_REPACK layouts for AVX2 (q4_1, q8_0, q6_k have none there)
DEQUANTIZED = ("q4_1", "q4_k")   # the bundled model's type and the K-quant files' most common one, as prompt rows
CYCLE_BYTES = 512 << 20          # float32 bytes the copies of a weight span, far past any cache


def candidates(weights: list[torch.Tensor], x: torch.Tensor, threads: int) -> dict[str, tuple[list, int]]:
    """name → (one call per weight copy, the bytes each call reads), on CPU."""
    out_features, in_features = weights[0].shape
    found = {"torch float32": ([lambda w=w: F.linear(x, w) for w in weights], weights[0].numel() * 4)}
    halves = [w.bfloat16() for w in weights]
    x16 = x.bfloat16()
    found["torch bfloat16"] = ([lambda w=w: F.linear(x16, w) for w in halves], weights[0].numel() * 2)
    scales = [w.abs().amax(1) / 127 for w in weights]
    int8 = [(w / s[:, None]).round().to(torch.int8) for w, s in zip(weights, scales)]
    found["torch int8 (_weight_int8pack_mm)"] = (
        [lambda w=w, s=s: torch._weight_int8pack_mm(x, w, s) for w, s in zip(int8, scales)], weights[0].numel())
    # the K-quants' blocks are 256 columns: only where the width is whole blocks
    types = {name: t for name, t in GGML_TYPES.items() if name not in K_QUANTS or in_features % 256 == 0}
    if ggml.available():
        for name, ggml_type in types.items():
            for repacked in (False, True) if name in REPACKED else (False,):
                try:
                    products = [ggml.Product(ggml.quantize(w, ggml_type, threads), ggml_type, in_features,
                                             out_features, len(x), threads, repacked) for w in weights]
                except ValueError:      # no repacked layout for the type on this CPU
                    continue
                for product in products:
                    product.x.copy_(x)
                found[f"ggml {name}{' repacked' if repacked else ''}"] = ([product.run for product in products],
                                                                          products[0].weight.numel())
                if name in DEQUANTIZED and not repacked:
                    blocks = [QuantizedWeight(product.weight, ggml_type, in_features) for product in products]
                    for dtype in (torch.float32, torch.bfloat16):
                        found[f"ggml {name} dequantized + torch {str(dtype).removeprefix('torch.')}"] = (
                            [lambda q=q, dtype=dtype: dequantized_product(q, x, dtype) for q in blocks],
                            products[0].weight.numel())
    if llama_cpp.available():       # the llama.cpp column's own kernels, over the same types
        for name, ggml_type in types.items():
            products = llama_cpp.Products(weights, ggml_type, len(x), threads)
            products.x.copy_(x)
            found[f"ik_llama.cpp {name}"] = (products.calls, products.nbytes)
    return found


def cuda_candidates(weights: list[torch.Tensor], device: torch.device, dtype: torch.dtype
                    ) -> dict[str, tuple[list, int]]:
    """On CUDA: name → (per weight copy, a product of rows x in dtype by it; the bytes each reads), prepared once
    per shape (quantizing takes longer than measuring). dtype: bfloat16 as served, or another (float32 on CPU: the
    tests, in Triton's interpreter)."""
    in_features = weights[0].shape[1]
    ids = torch.arange(weights[0].shape[0], device=device)      # every row, for the dequantized candidates
    dense = [w.to(device, dtype) for w in weights]
    found = {DENSE: ([lambda x, w=w: F.linear(x, w) for w in dense], dense[0].numel() * dtype.itemsize)}
    for kind in PACKED_TYPES:
        if in_features % GGML_QUANT_SIZES[kind][0]:     # rows not whole blocks (the K-quants', IQ4_XS's 256)
            continue
        packed = [pack(ggml.quantize(w, int(kind)), int(kind), in_features, device, dtype) for w in weights]
        found[f"kvtier Triton {kind.name}"] = ([lambda x, p=p: p.product(x) for p in packed], packed[0].nbytes)
        if kind == GGMLQuantizationType.Q4_0:      # the weight dequantized, then cuBLAS: other types' prompt rows
            found["dequantize Q4_0 + dense"] = (_dequantized_then_dense(packed, ids), packed[0].nbytes)
        # what kvtier runs for Q4_0 and Q4_1 decode rows where tinygemm takes them (int4pack.py); beside it, a
        # candidate for those rows over the same layout (triton_int4pack.product), and what their prompt rows take
        tinygemm = [int4packed(p) for p in packed]
        if isinstance(tinygemm[0], Int4PackWeight):
            nbytes = tinygemm[0].nbytes
            found[f"kvtier tinygemm {kind.name}"] = ([lambda x, p=p: p.product_with(x, TINYGEMM) for p in tinygemm],
                                                     nbytes)
            if triton_int4pack.takes(*weights[0].shape):
                splits = triton_int4pack.decode_splits(*weights[0].shape, device)
                found[f"split-K Triton {kind.name} (tinygemm's layout)"] = (
                    [lambda x, p=p, s=splits: p.product_with(x, s) for p in tinygemm], nbytes)
            found[f"dequantize {kind.name} from tinygemm's layout + dense"] = (_dequantized_then_dense(tinygemm, ids),
                                                                             nbytes)
    return found


def _dequantized_then_dense(weights: list, ids: torch.Tensor) -> list:
    """Per weight copy, a product that dequantizes its rows ids (all of them) and multiplies them by cuBLAS."""
    return [lambda x, w=w: F.linear(x, w.rows(ids)) for w in weights]


def measure(args: argparse.Namespace) -> list[dict]:
    rows, device = [], torch.device(args.device)
    for shape in args.shapes:
        in_features, out_features = (int(d) for d in shape.split("x"))
        copies = max(2, min(64, CYCLE_BYTES // (in_features * out_features * 4)))
        gen = torch.Generator().manual_seed(0)
        weights = [torch.randn(out_features, in_features, generator=gen) / in_features ** 0.5 for _ in range(copies)]
        prepared = cuda_candidates(weights, device, torch.bfloat16) if device.type == "cuda" else None
        for m in args.rows:
            x = torch.randn(m, in_features, generator=gen)
            want = F.linear(x, weights[0])
            if prepared is None:
                found = candidates(weights, x, args.threads)
            else:
                x = x.to(device, torch.bfloat16)
                found = {name: ([lambda f=f: f(x) for f in products], nbytes)
                         for name, (products, nbytes) in prepared.items()}
            for name, (calls, nbytes) in found.items():
                seconds = timed(calls, device)
                error = ((calls[0]().float().cpu() - want).abs().max() / want.abs().max()).item()
                rows.append({"shape": shape, "rows": m, "name": name, "ms": seconds * 1e3, "bytes": nbytes,
                             "error": error})
                print(f"  {shape} x{m} {name}: {seconds * 1e3:.3f} ms ({nbytes / seconds / 1e9:.1f} GB/s of "
                      f"weights), max error {error:.3f}", flush=True)
    return rows


def render(rows: list[dict], args: argparse.Namespace, command: str) -> str:
    cuda = args.device.startswith("cuda")
    baseline = DENSE if cuda else "torch float32"
    table = [f"| weight (in × out) | rows | kernel | ms | GB/s of weight read | × {baseline} | max error / max |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        base = next(b for b in rows if b["shape"] == r["shape"] and b["rows"] == r["rows"] and
                    b["name"] == baseline)
        table.append(f"| {r['shape']} | {r['rows']} | {r['name']} | {r['ms']:.3f} | {r['bytes'] / r['ms'] / 1e6:.1f} | "
                     f"{base['ms'] / r['ms']:.2f} | {r['error']:.3f} |")
    if cuda:
        machine = f"{torch.cuda.get_device_name(args.device)}, torch {torch.__version__}"
        return "\n".join([
            *header(CUDA_SECTION, machine, command), *table, "",
            f"How: per shape, enough random weights that their float32 copies span {CYCLE_BYTES >> 20} MiB (2 to "
            "64), each kernel cycling through its own copies (quantized once, before timing: GGUF's blocks by ggml, "
            "packed as kvtier loads them), best of 3 passes, bfloat16 rows of random input. Error: the largest "
            "difference from float32 `F.linear` over the largest output.", ""])
    machine = f"{cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__}, {args.threads} threads"
    note = "" if ggml.available() else " ggml's rows are missing: the libggml-python wheel is not installed."
    note += (" \"ik_llama.cpp\": the same types through the ik-llama-cpp-python wheel's own ggml (the kernels of "
             "the benchmarks' llama.cpp column), each product a graph computed on its OpenMP threads, which spin "
             "between calls where ggml's above sleep (a product of one row of a small weight carries ggml's "
             "threads waking)." if llama_cpp.available() else
             " No ik_llama.cpp rows: there is no ik-llama-cpp-python wheel here.")
    return "\n".join([
        *header(SECTION, machine, command),
        *table,
        "",
        f"How: per shape, enough random float32 weights that their copies span {CYCLE_BYTES >> 20} MiB (2 to 64), "
        "each kernel cycling through its own copies (quantized once, before timing), best of 3 passes; rows of "
        "random input. Error: the largest difference from float32 `F.linear` over the largest output. torch's int8 "
        "kernel is per output channel; ggml's types are GGUF's blocks, quantized by ggml itself, and its products "
        f"run on a threadpool of {args.threads} threads kept between calls, which sleep between products (threads "
        f"that poll would starve torch's threads inside a model: kvtier's decode at batch 1 fell from 49 to 3 tok/s "
        f"with polling ggml threads). \"repacked\": the blocks copied into ggml's CPU_REPACK layout, rows interleaved "
        f"for its multi-row kernels; kvtier takes it for Q4_0 and keeps the file's layout for Q4_K (the module's "
        "docstring says why). "
        "\"dequantized\": what prompt rows take, the blocks dequantized by ggml a slice at a time (the K-quants and "
        "BF16 on torch's threads, the other types on one: `QuantizedWeight.dequantize`), for torch's product (in "
        f"bfloat16 the slice copied to bfloat16 first; kvtier takes it where the CPU has bfloat16 dot products).{note}",
        "",
    ])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvtier bench kernels", description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", type=name_list, default=["576x1536", "1536x576", "4096x4096", "4096x14336"],
                   help="weights as in_features x out_features")
    p.add_argument("--rows", type=int_list, default=[1, 8], help="input rows (1: a decode at batch 1)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="threads for torch and ggml")
    p.add_argument("--device", default="cpu", help="cpu, or cuda for the GPU's candidates")
    add_output_args(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args, command = parse_command("kvtier.bench.kernels", argv, parse_args)
    torch.set_num_threads(args.threads)
    publish(render(measure(args), args, command), args)


if __name__ == "__main__":
    main()
