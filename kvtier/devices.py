"""The current CUDA device is per thread: every thread that runs streams, events, graphs or synchronizations makes
the engine's device current first, or `--device cuda:1` would use device 0 for whatever names no device."""
from __future__ import annotations

from collections.abc import Callable

import torch


def bind_thread(device: torch.device) -> None:
    """Make device the calling thread's current CUDA device (nothing on CPU, nor for a plain "cuda", which means
    the current device)."""
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)


def on_device(device: torch.device, target: Callable[[], None]) -> Callable[[], None]:
    """A thread target that binds its thread to device, then runs target."""
    def run() -> None:
        bind_thread(device)
        target()
    return run
