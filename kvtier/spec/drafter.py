"""What the model drafters (draft_model.py, dflash.py) share: a KV manager of their own, and per request a shadow
Sequence whose cached prefix is looked up below the device as the request waits."""
from __future__ import annotations

from kvtier.engine.sequence import Sequence
from kvtier.kv.manager import KVManager
from kvtier.kv.pool import KVPool


class ShadowDrafter:
    name: str
    pool: KVPool
    kv: KVManager
    shadows: dict[str, Sequence]     # request id → its shadow
    # seconds of its own work over its life, beside its proposals and the model's steps (a DFlash drafter writing
    # rows that waited): the engine leaves it out of what it learns proposals and steps cost
    writing: float = 0.0

    @property
    def build_seconds(self) -> float:
        """Seconds its decode graphs have taken to build, over its life (a draft model's: ModelRunner's)."""
        return 0.0

    def stats(self) -> dict:
        return {"model": self.name, "num_blocks": self.pool.num_blocks, "num_free_blocks": self.pool.num_free_blocks,
                "num_cached_blocks": self.pool.num_cached_blocks, **self.kv.stats()}

    def poll(self, waiting: list[Sequence]) -> None:
        """Each step: landed copies, and lookups of the waiting requests' drafter prefixes below the device. A
        request waits to be admitted while its drafter prefix loads (`Sequence.drafter_loading`), so that a restored
        conversation proposes from its first decode step."""
        self.kv.poll()
        shadows = [self.shadows[s.request_id] for s in waiting]
        self.kv.start_loads([shadow.kv for shadow in shadows])
        for seq, shadow in zip(waiting, shadows):
            seq.drafter_loading = shadow.kv.loading
