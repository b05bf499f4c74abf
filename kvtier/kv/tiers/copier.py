"""Where the mover's copies run and the order they keep (invariant 1: a device block is never reused while a copy
from or into it is in flight; compute never waits on a transfer).

A copy is handed over with a mark taken on the compute stream (`ready`): it runs after the compute queued before
it (the step that filled a block it copies out, say) and beside the compute queued after. A worker runs it inside
`copying`, which returns only once the copy has landed; the worker then reports it, and only then does the engine
free or reuse the blocks it named. On CUDA the copies run on a stream of their own; on CPU they run inline on the
worker. Tests record these calls (tests/test_copier.py) to check the order on a machine without a GPU.
"""
from __future__ import annotations

import contextlib
import threading

import torch


class Copier:
    """CPU: a copy runs inline on the worker that asks for it, so it has landed when `copying` returns."""

    def ready(self) -> object:
        """A mark on the compute stream now: a copy handed over with it runs after the compute queued so far."""
        return None

    @contextlib.contextmanager
    def copying(self, ready: object, reads: list[int] = (), writes: list[int] = ()):
        """Run the copies made inside after `ready`; on leaving, even by an error, they have landed (or stopped).
        reads / writes: the device blocks they copy out of / into, which no one may reuse until the worker reports
        the copy (the copiers here need not know them; a test's recording copier checks the engine by them)."""
        yield

    def wait(self, mark: object) -> None:
        """The calling thread waits until the compute queued before `mark` is done (a host buffer it read is free)."""


class CudaCopier(Copier):
    """A copy stream per worker thread: a worker that waits for its copies to land waits for no other worker's."""

    def __init__(self, device: torch.device):
        self.device = device
        self._local = threading.local()

    @property
    def stream(self) -> torch.cuda.Stream:
        if not hasattr(self._local, "stream"):
            self._local.stream = torch.cuda.Stream(self.device)
        return self._local.stream

    def ready(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record()          # on the compute (current) stream
        return event

    @contextlib.contextmanager
    def copying(self, ready: torch.cuda.Event, reads: list[int] = (), writes: list[int] = ()):
        stream = self.stream
        stream.wait_event(ready)            # the copy stream waits for compute, never the other way round
        try:
            with torch.cuda.stream(stream):
                yield
        finally:                            # landed, or failed part-way: either way no copy is left running when
            stream.synchronize()            # the worker reports and the engine frees the blocks

    def wait(self, mark: torch.cuda.Event | None) -> None:
        if mark is not None:
            mark.synchronize()


def copier_for(device: torch.device) -> Copier:
    return CudaCopier(device) if device.type == "cuda" else Copier()
