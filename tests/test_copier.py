"""The order the mover's copies keep, checked on CPU through a copier that records them (standing in for CUDA's copy
stream): every copy runs on a worker, never on the engine's thread, and no device block is allocated again, written
by a step, or read by a step while a copy into it is in flight. Each copy is held in flight a while, as a busy copy
stream would, so that an engine freeing a block before its copy is reported would be caught."""
import threading
import time

from kvtier.config import Config
from kvtier.engine.engine import LLMEngine
from kvtier.engine.sampling_params import SamplingParams
from kvtier.kv.tiers.copier import Copier

BS = 16
BUDGET = 8       # bounded residency: blocks page out and in


class RecordingCopier(Copier):
    def __init__(self, engine_thread: threading.Thread, hold_s: float = 0.01):
        self.engine_thread, self.hold_s = engine_thread, hold_s
        self.reading: set[int] = set()       # device blocks being copied out of
        self.writing: set[int] = set()       # device blocks being copied into
        self.copies = {"reads": 0, "writes": 0}
        self.on_engine_thread = 0
        self.lock = threading.Lock()

    def copying(self, ready, reads=(), writes=()):
        copier = self

        class Copying:
            def __enter__(self):
                with copier.lock:
                    copier.on_engine_thread += threading.current_thread() is copier.engine_thread
                    copier.reading.update(reads)
                    copier.writing.update(writes)
                    copier.copies["reads"] += bool(reads)
                    copier.copies["writes"] += bool(writes)

            def __exit__(self, *exc):
                time.sleep(copier.hold_s)        # the copy lands a while after it was made
                with copier.lock:
                    copier.reading.difference_update(reads)
                    copier.writing.difference_update(writes)
        return Copying()

    def in_flight(self) -> tuple[set[int], set[int]]:
        with self.lock:
            return set(self.reading), set(self.writing)


def watched_engine(tiny_model_dir, tmp_path, pool_blocks=48) -> tuple[LLMEngine, RecordingCopier, list[str]]:
    """An engine whose copies are recorded, with its allocations and steps checked against those in flight."""
    engine = LLMEngine(Config(model=tiny_model_dir, block_size=BS, kv_pool_tokens=pool_blocks * BS,
                              max_batched_tokens=64,
                              prefix_cache=False, kv_host_gib=0.01, kv_disk_dir=str(tmp_path),
                              kv_resident_tokens=BUDGET * BS, kv_reselect_every=2))
    copier = RecordingCopier(threading.current_thread())
    engine.kv.mover.copier = copier
    violations = []
    allocate = engine.pool.allocate

    def checked_allocate(n, after=None, wants=0):
        blocks = allocate(n, after=after, wants=wants)
        reading, writing = copier.in_flight()
        if set(blocks) & (reading | writing):
            violations.append(f"allocated {sorted(set(blocks) & (reading | writing))} while a copy uses them")
        return blocks
    engine.pool.allocate = checked_allocate
    prepare = engine.runner.prepare

    def checked_prepare(batch, capture=None):
        token_ids, meta, last_rows = prepare(batch, capture)
        reading, writing = copier.in_flight()
        written = set((meta.slot_mapping // BS).tolist())
        # its resident blocks, and the device blocks of page-outs in flight, which a prompt chunk's gather reads
        read = {b for seq in batch.seqs for b in seq.kv.block_table if b >= 0} | set(engine.kv.paging_out.values())
        if written & (reading | writing):
            violations.append(f"a step writes {sorted(written & (reading | writing))} while a copy uses them")
        if read & writing:
            violations.append(f"a step reads {sorted(read & writing)} while a copy writes them")
        return token_ids, meta, last_rows
    engine.runner.prepare = checked_prepare
    return engine, copier, violations


def prompt(n: int, salt: int) -> list[int]:
    return [(17 * i + salt) % 900 + 20 for i in range(n)]


def test_no_block_is_reused_or_touched_by_compute_while_a_copy_uses_it(tiny_model_dir, tmp_path):
    engine, copier, violations = watched_engine(tiny_model_dir, tmp_path)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    short = prompt(90, salt=1)
    for i in range(3):         # bounded: page-outs, page-ins and saves, three sequences at once
        engine.add_request(f"long{i}", prompt(260, salt=10 + i), params)
    engine.add_request("short", short, params)
    finished = {}
    while engine.has_unfinished():
        finished.update((out.request_id, out) for out in engine.step() if out.finished)
    engine.add_request("again", short, params)     # under the budget: its prefix loads from the host tier
    while engine.has_unfinished():
        finished.update((out.request_id, out) for out in engine.step() if out.finished)
    assert len(finished) == 5 and finished["again"].num_cached_tokens == 89 // BS * BS
    assert engine.stats()["residency"]["page_ins"] > 0
    assert copier.copies["reads"] > 0 and copier.copies["writes"] > 0
    assert copier.on_engine_thread == 0
    assert violations == []
    while not engine.kv.idle():
        engine.kv.wait(0.05)
    engine.kv.poll()
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
    engine.shutdown()


def test_the_check_catches_a_block_freed_before_its_copy_lands(tiny_model_dir, tmp_path):
    """The same check against an engine with a bug planted: the hold a save takes on its blocks is dropped at
    hand-over, not when the copy is reported. Caught: a block goes to another sequence while it is copied out."""
    engine, copier, violations = watched_engine(tiny_model_dir, tmp_path, pool_blocks=8)   # blocks are reused
    copier.hold_s = 1.0
    kv = engine.kv
    save, poll = kv.mover.save, kv.mover.poll

    def save_and_release_at_once(keys, blocks):
        save(keys, blocks)
        engine.pool.free(blocks)

    def poll_without_saves():
        events = poll()
        kv.num_saving -= len(events.saved)
        events.saved.clear()         # released at hand-over already
        return events
    kv.mover.save, kv.mover.poll = save_and_release_at_once, poll_without_saves
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    engine.add_request("a", prompt(100, salt=3), params)
    engine.add_request("b", prompt(60, salt=4), SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    deadline = time.monotonic() + 60
    while engine.has_unfinished() and not violations and time.monotonic() < deadline:
        engine.step()
    assert violations and "while a copy uses them" in violations[0]
    engine.shutdown()
