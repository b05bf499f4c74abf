"""Kernels chosen by measurement, on the device they will run on, at load: among candidate products for the weights
of one shape, the one that multiplies their rows in the least time, of those that give the first candidate's result
(a candidate that fails or disagrees on this device is never chosen: the first stays). On CUDA each candidate's
products are captured in a CUDA graph and timed as replays, as decode steps run them: its launch costs, which a graph
does away with, do not count against it."""
from __future__ import annotations

import functools
import math
import time
from typing import Callable

import torch

AGREEMENT = 2 ** -6      # of the reference's largest output: products that round otherwise (bfloat16: 2^-8) still agree
MARGIN = 0.9             # another candidate is chosen over the first only at this fraction of its time or less, so
                         # that a near tie does not flip from start to start (each rounds a little otherwise)
REPEATS = 3              # passes over the weights per candidate and row count; the best counts
REPLAYS = 8              # a CUDA graph's replays a pass: one sync's cost spread (a shape may have one weight)


def fastest(candidates: dict[str, Callable[[object, torch.Tensor], torch.Tensor]], weights: list, in_features: int,
            rows: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> tuple[str, dict[str, float]]:
    """The candidate (name → product(weight, x)) that multiplies x of each row count in `rows` by every weight, one
    after another (so that each reads its weight from memory, not from a cache), in the least time summed over the
    row counts; and each one's seconds per product, summed so (inf where it failed or disagreed with the first)."""
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randn(m, in_features, generator=generator).to(device, dtype) for m in rows]
    first = next(iter(candidates))
    references = [candidates[first](weights[0], x) for x in inputs]
    seconds = {}
    for name, product in candidates.items():
        try:
            agrees = name == first or all(_agree(product(weights[0], x), ref) for x, ref in zip(inputs, references))
            seconds[name] = sum(_seconds_per_product(product, weights, x) for x in inputs) if agrees else math.inf
        except Exception:       # a kernel that does not build or run here
            seconds[name] = math.inf
            sync(device)        # unless the failure broke the device, which must not pass unnoticed
    best = min(seconds, key=seconds.get)
    return (best if seconds[best] <= MARGIN * seconds[first] else first), seconds


def _agree(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.shape == want.shape and bool((got.float() - want.float()).abs().max()
                                            <= AGREEMENT * want.float().abs().max())


def _seconds_per_product(product: Callable, weights: list, x: torch.Tensor) -> float:
    calls = [functools.partial(product, weight, x) for weight in weights]
    if x.device.type != "cuda":
        return timed(calls, x.device)
    graph = torch.cuda.CUDAGraph()
    # thread-local: another thread's CUDA calls meanwhile (a tier mover's) do not invalidate the capture
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for call in calls:
            call()
    return timed([graph.replay] * REPLAYS, x.device) / len(calls)


def timed(calls: list[Callable[[], object]], device: torch.device, repeats: int = REPEATS) -> float:
    """Seconds per call, the calls one after another, best of `repeats` passes over them all."""
    best = math.inf
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        for call in calls:
            call()
        sync(device)
        best = min(best, (time.perf_counter() - start) / len(calls))
    return best


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
