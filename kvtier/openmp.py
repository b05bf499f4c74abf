"""torch's OpenMP threads, stopped on demand.

After a parallel region GNU libgomp's threads spin (300,000 pauses by default, several ms) before they sleep, on the
cores ggml's threads need when a decode graph runs right after torch's ops: on a 2-core EPYC a stream's decode
graph took 19-26 ms right after a 63-token prompt chunk beside it, 13-15 ms otherwise. Setting torch's thread count
does not stop them. `omp_pause_resource_all` (OpenMP 5.0) ends the calling thread's team at once, and its next
parallel region starts a new one (~0.1 ms). A smaller spin count for the whole process (GOMP_SPINCOUNT=10000) made
prompt chunks slower instead: their threads fell asleep between ops. Each thread that runs torch's parallel regions
has a team of its own: this ends the engine thread's (which runs the prompt chunks), not the tiers' copy threads'.
"""
from __future__ import annotations

import ctypes
import functools
import glob
import os

import torch

OMP_PAUSE_SOFT = 1      # enum omp_pause_resource_t


@functools.cache
def _pause_all():
    """libgomp's omp_pause_resource_all, where torch ships libgomp (its Linux wheels), else None."""
    for path in sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp*.so*"))):
        try:
            pause = ctypes.CDLL(path).omp_pause_resource_all     # the copy torch loaded: dlopen gives it back
        except (OSError, AttributeError):
            continue
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        return pause
    return None


def stop_spinning() -> None:
    """End the calling thread's OpenMP team now, so that its spinning threads leave their cores (nothing where
    torch runs another OpenMP)."""
    if (pause := _pause_all()) is not None:
        pause(OMP_PAUSE_SOFT)
