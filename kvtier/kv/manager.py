"""The KV manager: the one owner of every request's KV state (kv/state.py) and the only writer of
block tables. It decides where each block lives; the mover (tiers/mover.py) carries the bytes.

The engine talks to it in a few verbs:
- `new_state` when a request arrives; `start_loads` each step for the waiting ones: a prompt whose
  prefix continues below the device gets device blocks reserved and a load started, as the load
  planner (planner.py) says, and waits in its own state (`state.loading`) while the engine steps
  everyone else, or computes the front of its prefix meanwhile (rates.py);
- `admit` / `reserve` give a scheduled sequence its cached prefix and the blocks its next tokens
  need (paging out first under bounded residency), `chunk` caps a prefill chunk;
- `commit` after a step: residency bookkeeping (page-outs and page-ins), then every block the
  step filled is sealed under its key and saved to the tiers in the background;
- `release` (preemption) and `finish` give blocks back (a finished exact sequence keeps its last,
  partly filled block for the next turn: partials.py); `abort` of a loading request waits for
  its copy to land; `poll` applies landed copies.
"""
from __future__ import annotations

import logging
import threading
import weakref

import torch

from kvtier.kv.keys import block_key, chain_keys
from kvtier.kv.manifest import ManifestStore
from kvtier.kv.pager import Pager
from kvtier.kv.partials import PartialBlocks
from kvtier.kv.planner import LoadPlan, LoadPlanner
from kvtier.kv.pool import KVPool
from kvtier.kv.rates import Rates
from kvtier.kv.state import NOT_RESIDENT, KVState
from kvtier.kv.tiers.mover import LoadJob, Mover, PageIn, PageOut
from kvtier.kv.tiers.stack import TierStack

log = logging.getLogger("kvtier.kv.manager")

# decode tokens a sequence may take for its scattered prefix hit to be copied into one run (`_run_for`): the copy took
# about three of the gathered steps it saves (25 ms against 8.5 ms more a step, 6K tokens of the bundled model)
RUN_COPY_DECODES = 16
LOAD_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class KVManager:
    def __init__(self, pool: KVPool, stack: TierStack, pager: Pager | None = None,
                 manifests: ManifestStore | None = None, partials_dir: str | None = None,
                 rates_file: str | None = None):
        self.pool, self.stack, self.pager, self.manifests = pool, stack, pager, manifests
        self.block_size = pool.block_size
        self.mover = Mover(pool, stack, manifests) if stack else None
        # the mover's threads keep it, the pool and the tiers alive: a manager dropped without shutdown stops them,
        # from a thread of its own (the collector may run on any thread, which must not wait on the mover's)
        if self.mover:
            self._stop_mover = weakref.finalize(self, _stop_in_background, self.mover)
            self._stop_mover.atexit = False      # at exit the threads are daemons, as they always were
        self.loading: dict[str, KVState] = {}     # loads in flight, by request id
        self.partials = PartialBlocks(pool.namespace, partials_dir)
        self.rates = Rates(pool.block_bytes // pool.block_size, rates_file)
        saving_run = self.mover.saving_run if self.mover else (lambda keys: 0)
        self.planner = LoadPlanner(pool, stack, self.rates, self.partials, pager, manifests, saving_run)
        self.num_saving = 0                       # block runs pinned for a copy that has not landed
        self.saving: dict[bytes, int] = {}        # key → device block whose save is in flight (held until it lands)
        self.num_paging = 0                       # page-outs and page-ins in flight
        self.paging_out: dict[bytes, int] = {}    # key → device block whose copy to the host tier is in flight
        self._warned = False
        self.load_counts = [0] * (len(LOAD_BUCKETS) + 1)   # per bucket, the last one is +Inf
        self.load_seconds_sum = 0.0

    def fault_in_buffers(self) -> None:
        """Fault in now the read buffers (a restore from below the host tier, a bounded prompt's paged-out blocks),
        so that the first request that needs them does not pay for it."""
        if self.mover:
            self.mover.fault_in_buffers()

    def new_state(self, request_id: str, token_ids: list[int], max_tokens: int, root_key: bytes | None,
                  pins: list[tuple[int, int]] | None = None) -> KVState:
        """Raises PinRefused for pins the pager cannot honour."""
        state = KVState(request_id, token_ids, max_tokens, root_key)
        if self.pager:
            state.residency = self.pager.new_residency(pins, len(token_ids))
        return state

    @property
    def busy(self) -> bool:
        return (bool(self.loading) or self.num_saving > 0 or self.num_paging > 0
                or (self.mover is not None and self.mover.paging()))

    # --- admission -------------------------------------------------------------------------------

    def prompt_keys(self, state: KVState) -> list[bytes]:
        """Exact keys of every full block before the last token (which is always computed, for fresh
        logits): hashed once per admission."""
        cached = state.prompt_keys
        if cached is None or len(cached) != (len(state.token_ids) - 1) // self.block_size:
            state.prompt_keys = chain_keys(state.token_ids[:-1], self.block_size, self.pool.namespace,
                                           state.root_key)
        return state.prompt_keys

    def start_loads(self, states: list[KVState]) -> None:
        """Look each new waiting request up below the device; reserve blocks and start its load."""
        if not self.stack:
            return
        for state in states:
            if state.looked_up or state.loading or state.restored:
                continue
            if state.residency and not self.pager.reserve_host(state):
                continue     # a restore pins host blocks: wait for room in the host budget first
            state.looked_up = True
            exact = self.prompt_keys(state)
            plan, on_device = self.planner.bounded(exact) if state.residency else None, []
            if plan is None:
                on_device = self._device_prefix(exact[:self.planner.shared_limit])
                plan, held = self.planner.prefix(state, exact, len(on_device))
                state.held_tokens = max(state.held_tokens, held)
            if plan is None:
                self.pool.free(on_device)     # admission matches the device part again
                continue
            self._begin_load(state, plan, on_device)

    def _device_prefix(self, keys: list[bytes]) -> list[int]:
        """The blocks of the longest run of leading keys the device holds, referenced for the caller: cached ones,
        then those a save still holds (without a device prefix cache too: the next turn of an agent's loop, sent as
        the last answer arrives, shares them instead of waiting for the save and loading them back)."""
        blocks = self.pool.match_prefix(keys)
        for key in keys[len(blocks):]:
            block = self.saving.get(key)
            if block is None:
                break
            self.pool.pin([block])
            blocks.append(block)
        return blocks

    def _begin_load(self, state: KVState, plan: LoadPlan, on_device: list[int]) -> None:
        """Reserve the plan's blocks (after those the device holds), write the state, start the copy. The
        blocks stay the request's until the load lands: an abort or a miss frees them then."""
        blocks = self.pool.allocate(plan.num_blocks, after=_last_block(on_device), wants=self._wants(state, on_device))
        state.block_table = on_device + blocks
        state.block_keys = self.prompt_keys(state)[:len(on_device)]
        state.load_from = (len(on_device) + plan.front) * self.block_size
        state.compute_first = plan.front > 0
        state.num_cached_tokens = len(on_device) * self.block_size
        state.tier_tokens = plan.tier_tokens
        state.loading = True
        self.loading[state.request_id] = state
        self.mover.load(LoadJob(state.request_id, plan.keys, blocks[plan.front:plan.front + len(plan.keys)],
                                plan.manifest_key, plan.resident, partial_tokens=plan.partial_tokens))

    def _wants(self, state: KVState, held: list[int]) -> int:
        """Blocks a sequence holding `held` may still want: room for all of it where the pool has it (none for a
        bounded one, whose context is gathered anyway: sink, selected blocks, tail)."""
        return 0 if state.residency else self.pool.blocks_for(state.max_tokens) - len(held)

    def _partial_on_device(self, hit: tuple[bytes, int] | None, after: int | None,
                           wants: int) -> tuple[int, int] | None:
        """Copy-on-write of a cached partial block continuing the prompt's full blocks (hit: the planner's
        `partial_after`; the last full block in block `after`): (a block holding it, the tokens it gives), or None.
        Where the partial block follows `after` in the pool and no one else holds it (a conversation's next turn, no
        save of it in flight), the copy is published in its stead and the sequence takes the block: its context stays
        in consecutive slots, which ggml's decode steps read in place (gathered, a 7.7K-token context cost a step
        ~40 ms more). The copy starts the longest run of empty blocks where it is published (in its middle it would
        cut the run a later sequence wants in two), else it is placed as a new sequence's blocks are, for `wants`."""
        if hit is None:
            return None
        key, n = hit
        found = self.pool.match_prefix([key])      # referenced, so allocating cannot evict it
        if not found:
            return None
        published = after is not None and found[0] == after + 1 and self.pool.ref_counts[found[0]] == 1
        copy = self.pool.allocate(1, wants=self.pool.num_blocks if published else wants) \
            if self.pool.can_allocate(1) else None
        if copy:
            self.pool.copy_block(found[0], copy[0])
        if copy and published:
            found, copy = copy, found
            self.pool.unseal(copy[0])
            self.pool.seal(found[0], key)
        self.pool.free(found)
        return (copy[0], n) if copy else None

    def admit(self, state: KVState, budget: int) -> tuple[int, int] | None:
        """Give a waiting sequence its cached prefix and blocks for its first chunk (at most budget tokens):
        (tokens already computed, tokens to compute now), or None (it keeps waiting) when they do not fit."""
        if state.residency and not self.pager.reserve_host(state):
            return None     # its paged-out blocks would pass the host budget: wait for running sequences to end
        if state.block_table:     # a load reserved its blocks: it landed, or this computes the front meanwhile
            cached, keys = [], state.block_keys
            start = len(keys) * self.block_size if state.compute_first else state.restored
        else:
            cached = self._device_prefix(self.prompt_keys(state)[:self.planner.shared_limit])
            keys, start = state.prompt_keys[:len(cached)], len(cached) * self.block_size
        # a loaded table already has a block reserved where the copy would go: its load brought any partial
        hit = None if state.block_table else self.planner.partial_after(state, keys)
        copied = None if state.residency else self._partial_on_device(hit, _last_block(cached),
                                                                       self._wants(state, cached))
        if copied is not None:
            cached.append(copied[0])
            start += copied[1]
        # what the cache holds, copied here or not (a full pool), loaded or computed again
        state.held_tokens = max(state.held_tokens, start if state.block_table else
                                self.planner.held_tokens(keys, hit))
        n = self.chunk(state, start, min(len(state.token_ids) - start, budget))
        if state.residency and state.restored:     # restored over its budget: make room before growing
            self._page_out(state, self.pager.victims(state, start + n))
        held = state.block_table + cached
        need = max(0, self.pool.blocks_for(start + n) - len(held))
        if not self.pool.can_allocate(need):
            self.pool.free(cached)
            return None
        run = None if state.block_table else self._run_for(state, cached, need)
        if run is None:
            run = held + self.pool.allocate(need, after=_last_block(held), wants=self._wants(state, held))
        state.block_table = run
        state.block_keys = keys
        if not state.compute_first:      # one computing first takes its landed blocks up at load_from
            state.restored = 0
        if cached and not state.admitted:     # a preempted sequence keeps its first report
            state.tier_tokens = {**state.tier_tokens, "device": start - state.num_cached_tokens}
            state.num_cached_tokens = start
        state.admitted = True
        return start, n

    def _run_for(self, state: KVState, cached: list[int], need: int) -> list[int] | None:
        """A device prefix hit that would leave the sequence's blocks apart (they are, or the block after them is
        taken: a prompt sent again, a branch, requests sharing a system prompt): the cached blocks copied into the
        front of one run of empty blocks, the first chunk's blocks after them, where ggml's decode steps read a
        context in place: they gather one whose blocks lie apart every step, 1.25-1.4x its time at 300-7,700
        tokens. Only where the sequence may decode RUN_COPY_DECODES tokens or more and half the pool's empty blocks,
        or more, stay empty after the run; else None. A cached block no one else holds gives its key to its copy
        (`KVPool.move_key`), so that the next turn finds the conversation in one run; one that others hold keeps
        it, and its copy takes the pool's memory a second time while both are held. The copies hold the same bits,
        so the context computes as it would where it was cached."""
        # a transposed pool serves ggml's decode steps (engine/assembly.py), the only reader that gathers
        if not (self.pool.values_transposed and cached) or state.residency or \
                state.max_tokens - len(state.token_ids) < RUN_COPY_DECODES:
            return None
        apart = not self.pool.consecutive(cached)
        most = self.pool.blocks_for(state.max_tokens)
        # the blocks after its cached ones would go elsewhere: the block after its last is taken (a first answer's)
        blocked = most > len(cached) and not self.pool.continues(cached[-1])
        size = len(cached) + need
        if not (apart or blocked) or 2 * size > self.pool.num_empty_blocks:
            return None
        run = self.pool.allocate_run(size, most)
        if run is not None:
            self.pool.copy_blocks(cached, run[0])
            self.pool.free(cached)
            for original, copy in zip(cached, run):
                if self.pool.ref_counts[original] == 0:     # held by no one, no save in flight
                    self.pool.move_key(original, copy)
        return run

    def chunk(self, state: KVState, start: int, n: int) -> int:
        """At most n tokens from `start` in one step: under bounded residency, what the budget holds; computing
        first, none past the blocks that are loading (0 while it waits for them or was aborted meanwhile)."""
        if state.aborted:
            return 0
        if state.compute_first:
            return max(0, min(n, state.load_from - start))
        return self.pager.limit_chunk(state, start, n) if state.residency else n

    def take_landed(self, state: KVState, num_computed: int) -> int:
        """A sequence that computed its front while the rest of its prefix loaded: once both are done, its
        loaded blocks join its table's keys and it goes on after them. Returns its computed tokens."""
        if state.compute_first and not state.loading and num_computed == state.load_from:
            state.block_keys += state.landed_keys
            num_computed = state.num_computed = state.restored
            state.compute_first, state.landed_keys, state.restored = False, [], 0
        return num_computed

    def reserve(self, state: KVState, end: int) -> bool:
        """Blocks for tokens up to `end` (paging out first under bounded residency); False if the pool is short."""
        if state.residency:
            self._page_out(state, self.pager.victims(state, end))
        need = self.pool.blocks_for(end) - len(state.block_table)
        if not self.pool.can_allocate(need):
            return False
        state.block_table += self.pool.allocate(need, after=_last_block(state.block_table))
        return True

    def reserve_draft(self, state: KVState, end: int, k: int) -> int:
        """Room for up to k draft tokens after the first `end`, in the blocks the sequence holds and in empty ones
        only: a draft evicts no cached block (and, the scheduler's side, preempts no one). Returns how many fit."""
        need = self.pool.blocks_for(end + k) - len(state.block_table)
        if need > 0 and not state.residency:      # a bounded draft stays in its last block
            extra = min(need, self.pool.num_empty_blocks)     # counted only when needed: a scan of the pool
            state.block_table += self.pool.allocate(extra, after=_last_block(state.block_table))
        return min(k, len(state.block_table) * self.block_size - end)

    def truncate(self, state: KVState, end: int) -> None:
        """Give back the blocks past the first `end` tokens: a verify step reserved them for a draft that was
        rejected. Nothing in them was sealed: commit seals only blocks of accepted tokens."""
        keep = self.pool.blocks_for(end)
        if len(state.block_table) > keep:
            self.pool.free([b for b in state.block_table[keep:] if b != NOT_RESIDENT])
            del state.block_table[keep:]

    # --- after a step ----------------------------------------------------------------------------

    def commit(self, state: KVState, num_computed: int, queries: torch.Tensor | None, prompt_done: bool,
               decoded: bool) -> bool:
        """The step computed the sequence's K/V up to num_computed: move blocks as the pager says, then seal
        and save every block it filled. Returns whether blocks moved (a page-out, or a page-in started)."""
        state.num_computed = num_computed
        moved = False
        if state.residency:
            out, wanted = self.pager.after_step(state, queries, num_computed, prompt_done, decoded)
            self._page_out(state, out)
            moved = self._page_in(state, wanted) or bool(out)
        first = len(state.block_keys)
        # the block the prompt's last token lies in (after its full blocks before it, `prompt_keys`)
        prompt_end = None if state.residency or state.prompt_keys is None else len(state.prompt_keys)
        ends_prompt = None
        for i in range(first, num_computed // self.block_size):
            ns = self.pager.namespace_for(state, i) if state.residency else self.pool.namespace
            parent = state.block_keys[-1] if state.block_keys else state.root_key
            tokens = state.token_ids[i * self.block_size:(i + 1) * self.block_size]
            key = block_key(parent, tokens, ns)
            self.pool.seal(state.block_table[i], key)
            state.block_keys.append(key)
            if i == prompt_end:     # a prompt sent again or branching inside it takes the tokens it shares
                ends_prompt = parent, tokens, key
        if state.residency:
            self.pager.sealed(state)
        if len(state.block_keys) > first:
            self._save(state.block_keys[first:], state.block_table[first:len(state.block_keys)])
        if ends_prompt:      # remembered once the block is saved (`_remember`)
            self._remember(*ends_prompt)
        return moved

    def mark_bounded(self, state: KVState, position: int) -> None:
        """Under bounded residency: the sequence's tokens from `position` on depend on a partial resident set."""
        if state.residency:
            self.pager.mark_bounded(state, position)

    def _save(self, keys: list[bytes], blocks: list[int]) -> None:
        if self.mover:
            self.pool.pin(blocks)             # the slots stay ours until the copy lands
            self.saving.update(zip(keys, blocks))
            self.num_saving += 1
            self.mover.save(keys, blocks)

    def _page_out(self, state: KVState, blocks: list[int]) -> None:
        """Take these blocks off the device; their payloads stay pinned in the host tier. The mover's pager copies
        those not there yet (a block paged out before is), their device blocks held until it lands. A page-in
        still in flight is given up: its block is freed when it lands."""
        res = state.residency
        for i in blocks:
            res.paging_in.pop(i, None)
        resident = [i for i in blocks if state.block_table[i] != NOT_RESIDENT]
        copied = [i for i in resident if i not in res.offloaded]
        if copied:      # they count as offloaded once their pins land (`_land_page_out`)
            job = PageOut((state, res, copied), [state.block_keys[i] for i in copied],
                          [state.block_table[i] for i in copied])
            self.pool.pin(job.blocks)
            self.paging_out.update(zip(job.keys, job.blocks))
            self.num_paging += 1
            self.mover.page_out(job)
        self.pool.free([state.block_table[i] for i in resident])
        for i in resident:
            state.block_table[i] = NOT_RESIDENT
        self.pager.stats["page_outs"] += len(resident)

    def _page_in(self, state: KVState, blocks: list[int]) -> bool:
        """Bring these paged-out blocks back, as many as the pool has room for, in one copy by the mover's pager,
        which runs beside the rest of this step. They join the table at the next step (`poll`). Returns whether a
        copy started."""
        res = state.residency
        wanted = [i for i in blocks if i not in res.paging_in][:self.pool.num_free_blocks]
        if not wanted:
            return False
        job = PageIn((state, res, wanted), [state.block_keys[i] for i in wanted], self.pool.allocate(len(wanted)))
        res.paging_in.update(zip(wanted, job.blocks))
        self.num_paging += 1
        self.mover.page_in(job)
        return True

    def paged_out_kv(self, chunks: list[tuple[KVState, list[int]]]) -> list[torch.Tensor | None]:
        """Per prompt chunk (a bounded sequence, and its block table before the chunk): K/V [2, layers, tokens,
        kv_heads, head_dim] of the blocks that table leaves off the device, in block order (exact prefill attends to
        them too), or None: gathered by the mover (`Mover.gather`) from host memory, or from the device block of one
        whose page-out is still in flight, so that a chunk attends to the same parts in the same order however fast
        the copies ran. Call `forward_done` after the forward that reads them."""
        runs = [[state.block_keys[i] for i, b in enumerate(blocks) if b == NOT_RESIDENT] for state, blocks in chunks]
        return self.mover.gather(runs, self.paging_out)

    def forward_done(self) -> None:
        """The step's forward, which read what `paged_out_kv` gave, is queued: its buffer may be reused after it."""
        self.mover.gather_read()

    # --- the end of a request --------------------------------------------------------------------

    def release(self, state: KVState) -> None:
        """Give back everything the sequence holds; it may be admitted again (preemption). One computing first
        while a copy into its blocks is in flight gives them back once it lands (`poll`)."""
        if state.loading:
            state.aborted = True
            return
        if state.residency:      # page-ins in flight land as strays and are freed then (`poll`)
            self.mover.unpin([state.block_keys[i] for i in state.residency.offloaded])
            self.pager.release(state)
        self.pool.free([b for b in state.block_table if b != NOT_RESIDENT])
        state.block_table, state.restored, state.looked_up = [], 0, False
        state.compute_first, state.landed_keys = False, []

    def finish(self, state: KVState) -> None:
        """A finished sequence: an exact one leaves its last, partly filled block for a next turn; a bounded one
        over its budget leaves its pager state beside its blocks."""
        if not state.residency:
            self._keep_partial(state)
        elif state.block_keys and len(state.block_table) > self.pager.budget_blocks:
            bs = self.block_size
            exact = chain_keys(state.token_ids[:len(state.block_keys) * bs], bs, self.pool.namespace, state.root_key)
            key, manifest = self.pager.manifest_key(exact[-1]), self.pager.manifest(state)
            # found by a next turn from now on, however soon it comes (its blocks' saves are waited for there)
            self.manifests.keep(key, manifest)
            self.mover.after_saves(self.manifests.write, key, manifest)
        self.release(state)

    def _keep_partial(self, state: KVState) -> None:
        """Publish the computed part of the last block under a key of its tokens (nothing writes to it again),
        and remember it and the last full block for prompts that share only their first tokens: a next turn
        diverges near the end of this one (a chat template's generation prompt, say)."""
        bs, full = self.block_size, len(state.block_keys)
        n = state.num_computed - full * bs
        if full:
            self._remember(state.block_keys[-2] if full > 1 else state.root_key,
                           state.token_ids[(full - 1) * bs:full * bs], state.block_keys[-1])
        if n <= 0 or full >= len(state.block_table):
            return
        parent = state.block_keys[-1] if full else state.root_key
        tokens = state.token_ids[full * bs:full * bs + n]
        key = block_key(parent, tokens, self.pool.namespace)
        self.pool.seal(state.block_table[full], key)
        self._save([key], [state.block_table[full]])
        self._remember(parent, tokens, key)

    def _remember(self, parent: bytes | None, tokens: list[int], key: bytes) -> None:
        if self.partials.add(parent, tokens, key) and self.mover:     # new: written after the block's own save
            self.mover.after_saves(self.partials.write, parent, tokens, key)

    def abort(self, state: KVState) -> bool:
        """True if the request is loading: its blocks are freed, and `poll` returns it, once its copy lands."""
        if state.loading:
            state.aborted = True
        return state.loading

    # --- landed copies ---------------------------------------------------------------------------

    def poll(self) -> list[KVState]:
        """Apply finished copies, without waiting for any; returns loading requests that were aborted meanwhile, now
        released. A sequence whose page-ins have not landed waits in its own state (`waits_for_pages`), so they join
        its table before its next step however fast they ran: its tokens never depend on timing."""
        if not self.mover:
            return []
        events = self.mover.poll()
        for keys, blocks in events.saved:
            for key, block in zip(keys, blocks):
                if self.saving.get(key) == block:
                    del self.saving[key]
            self.pool.free(blocks)
            self.num_saving -= 1
        for job in events.paged_out:
            self.num_paging -= 1
            self._land_page_out(job)
        for job in events.paged_in:
            self.num_paging -= 1
            self._land_page_in(job)
        aborted = []
        for job in events.loaded:
            self._observe_load(job.seconds)
            for tier, (nbytes, seconds) in job.tier_times.items():
                self.rates.observe_tier(tier, nbytes, seconds)
            state = self.loading.pop(job.request_id)
            state.loading = False
            if state.aborted:      # cancelled while loading: blocks (and host pins) are free only now
                if job.pinned:
                    self.mover.unpin([job.keys[i] for i in job.pinned])
                self.release(state)
                aborted.append(state)
            elif job.ok and job.manifest is not None:
                self._take_manifest(state, job)
            elif job.ok:
                full = len(job.keys) - bool(job.partial_tokens)    # a partial block's copy is the sequence's own
                for block, key in zip(job.blocks[:full], job.keys[:full]):
                    self.pool.seal(block, key)
                if state.compute_first:
                    state.landed_keys = job.keys[:full]
                else:
                    state.block_keys += job.keys[:full]
                state.restored = state.load_from + full * self.block_size + job.partial_tokens
                state.num_cached_tokens = state.tier_tokens["device"] + state.restored - state.load_from
            elif state.compute_first:      # it computes the rest too, into the blocks it holds
                self._warn_missed()
                state.compute_first = False
                state.tier_tokens = {"device": state.tier_tokens["device"]}
            else:
                self._missed(state, retry=job.manifest_key is not None)
        if (record := self.rates.pending()) is not None:     # written off this thread, now and then while serving
            self.mover.after_saves(self.rates.write, record)
        return aborted

    def _land_page_out(self, job: PageOut) -> None:
        """Pinned in the host tier, the blocks count as offloaded (their pins go with the sequence) and their
        device blocks are freed. A failed page-out pinned nothing: its blocks go back into the table, as they
        were before it (over the budget until the pager pages them out again)."""
        state, res, indices = job.owner
        live = state.residency is res
        for key in job.keys:
            self.paging_out.pop(key, None)
        if job.ok and live:
            res.offloaded.update(indices)
        elif job.ok:        # the sequence ended while the pins were landing
            self.mover.unpin(job.keys)
        if job.ok or not live:
            self.pool.free(job.blocks)
            return
        log.warning("%d blocks of %s could not be paged out; they stay on the device", len(job.keys),
                    state.request_id)
        for i, block in zip(indices, job.blocks):
            if state.block_table[i] != NOT_RESIDENT:
                self.pool.free([block])
                continue
            res.paging_in.pop(i, None)      # a page-in since, which may have nothing to read: lands as a stray
            state.block_table[i] = block    # the job's hold on it becomes the table's
            self.pager.placed(state, i)

    def _land_page_in(self, job: PageIn) -> None:
        """Paged-in blocks join the table, unless the sequence gave them up or was released meanwhile."""
        state, res, indices = job.owner
        live = state.residency is res
        for i, block in zip(indices, job.blocks):
            wanted = live and res.paging_in.get(i) == block
            if wanted:
                del res.paging_in[i]
            if wanted and job.ok:
                self.pool.seal(block, state.block_keys[i])
                state.block_table[i] = block
                self.pager.placed(state, i)
                self.pager.stats["page_ins"] += 1
            else:
                self.pool.free([block])
        if not job.ok:       # its page-out failed: the sequence goes on without it
            log.warning("%d paged-out blocks of %s could not be paged in", len(job.keys), state.request_id)

    def _warn_missed(self) -> None:
        if not self._warned:
            log.warning("a cached prefix could not be restored (damaged or evicted); recomputing it")
            self._warned = True

    def _missed(self, state: KVState, retry: bool) -> None:
        self._warn_missed()
        self.pool.free(state.block_table)
        state.block_table, state.block_keys, state.num_cached_tokens, state.tier_tokens = [], [], 0, {}
        # a manifest gone from the store: the next lookup restores the exact prefix only
        state.looked_up = not retry

    def _take_manifest(self, state: KVState, job: LoadJob) -> None:
        resident = [i for i, r in enumerate(job.manifest.resident) if r]
        placed = dict(zip(resident, job.blocks))
        for i, block in placed.items():
            self.pool.seal(block, job.keys[i])
        self.pool.free(job.blocks[len(resident):])      # reserved, not needed
        state.block_keys = list(job.keys)
        state.block_table = [placed.get(i, NOT_RESIDENT) for i in range(len(job.keys))]
        self.pager.restore(state, job.manifest)
        state.residency.offloaded.update(job.pinned)
        state.restored = state.num_cached_tokens = len(job.keys) * self.block_size

    def _observe_load(self, seconds: float) -> None:
        self.load_counts[next((i for i, le in enumerate(LOAD_BUCKETS) if seconds <= le), len(LOAD_BUCKETS))] += 1
        self.load_seconds_sum += seconds

    def wait(self, timeout: float) -> None:
        """Sleep until a copy lands (or timeout): for an engine with nothing to do but wait for one."""
        self.mover.wait(timeout)

    def idle(self) -> bool:
        """No copy is queued or in flight."""
        return self.mover is None or self.mover.idle()

    def shutdown(self) -> None:
        if self.mover:
            self._stop_mover.detach()
            self.mover.shutdown()      # after any copies it was still to make
        if (record := self.rates.pending(now=True)) is not None:
            self.rates.write(record)

    def stats(self) -> dict:
        if not self.stack:
            return {}
        return {"tiers": self.stack.stats(), "rates": self.rates.stats(), "load_buckets": LOAD_BUCKETS,
                "load_counts": list(self.load_counts), "load_seconds_sum": self.load_seconds_sum,
                "num_loading": len(self.loading)}


def _stop_in_background(mover: Mover) -> None:
    threading.Thread(target=mover.shutdown, name="kvtier-mover-stop", daemon=True).start()


def _last_block(table: list[int]) -> int | None:
    """The block a table's next one should follow in the pool (None for an empty table or a trailing hole)."""
    return table[-1] if table and table[-1] != NOT_RESIDENT else None
