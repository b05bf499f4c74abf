"""Watching an engine's forwards from a benchmark: which engine steps computed and what they ran."""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from kvtier.engine.engine import LLMEngine
from kvtier.engine.scheduler import ScheduledBatch


@contextlib.contextmanager
def forwards_seen(eng: LLMEngine, seen: Callable[[ScheduledBatch], None]) -> Iterator[None]:
    """Within: seen(batch) before each forward of the engine's runner; the runner as it was on leaving."""
    runner = eng.runner
    before = vars(runner).get("run")     # a patch already on the instance, kept
    run = runner.run

    def watched(batch: ScheduledBatch, capture: list[int] | None = None):
        seen(batch)
        return run(batch, capture)
    runner.run = watched
    try:
        yield
    finally:
        if before is None:
            del runner.run
        else:
            runner.run = before
