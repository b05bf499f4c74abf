"""`--speculative dflash --draft-model DIR`: a DFlash block drafter (models/dflash.py) proposes each decoding
sequence's next tokens in one forward, from the target's hidden features over its context.

The drafter's state over a context is the K/V its layers take from the target's features there: from the features
of the tokens the target computes (prompt chunks, decode and verify steps; of a verify step only the rows of tokens it
accepted), into a pool of the drafter's own under a namespace of the drafter's and the target's weights, sealed,
saved to the host and disk tiers and restored from them as the target's blocks are (its own KV manager, as
spec/draft_model.py has). So a conversation restored from a tier proposes from its first decode step what the
uninterrupted one would.

The writes wait until the drafter proposes for the sequence, or the request ends, or WRITE_AFTER rows wait: while
the speculator has a sequence sit out (a drafter whose proposals do not pay), its steps pay for none of the
drafter's work, and what waited is written in one forward (a projection of every feature layer's output per row,
which one row at a time read the projection's weights every step). The seconds they take (`writing`) are the
drafter's own work, whatever a step verifies: neither a proposal's cost nor a step's, as the engine learns them.

A shadow Sequence per request holds the drafter's state over the target's tokens. It looks its cached
prefix up as the request waits (its admission waits for a load of it in flight: `ShadowDrafter.poll`), and takes up
the target's features from where its cached prefix ends. The features of tokens the target did not compute (its
own cache held them) cannot be had: where the drafter's cached prefix is shorter than the target's, the request is
not drafted for (`lost`) and decodes as without speculation.

Under bounded residency the drafter's pool is bounded as the target's is, by its own pager (by recency: a window of
the latest blocks beside the sink), and a block proposal attends to the resident blocks. A token's drafter K/V
depend on its features alone, which depend on the target's window from where the target's K/V do
(`bounded_from`): from there on the drafter's blocks are keyed in its bounded namespace, which names the target's
policy too.
"""
from __future__ import annotations

import logging
import os
import time

import torch

from kvtier.config import Config
from kvtier.engine.assembly import build_kv, build_pool, digest_cache
from kvtier.engine.runner import slot_runs
from kvtier.engine.sequence import Sequence, SequenceStatus
from kvtier.models.decoder import Decoder
from kvtier.models.dflash import load_dflash
from kvtier.spec.drafter import ShadowDrafter

log = logging.getLogger("kvtier.spec")

WRITE_AFTER = 64      # rows of features a sequence keeps waiting at most before its drafter state is written


def dflash_weight_bytes(path: str) -> int:
    """What a DFlash drafter's weights take on the device (its safetensors files, about)."""
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))


class DFlashDrafter(ShadowDrafter):
    def __init__(self, config: Config, target: Decoder, fingerprint: str, share: float, device: torch.device,
                 pool_tokens: int, max_model_len: int):
        self.model, own = load_dflash(os.path.expanduser(config.draft_model), target.config, config.torch_dtype,
                                      device, digest_cache(config), max_model_len)
        self.target = target
        cfg = self.model.config
        self.block_size, self.mask_token_id, self.feature_layers = cfg.block_size, cfg.mask_token_id, \
            cfg.target_layer_ids
        # its K/V depend on the target's weights too
        self.pool = build_pool(config, cfg.layers, f"{own}+{fingerprint}", device, pool_tokens, "dflash")
        self.kv = build_kv(config, self.pool, max_model_len, share, cfg.layers.head_dim, f"{own}+{fingerprint}",
                           prompt_chunks=False)
        self.name = os.path.basename(os.path.abspath(config.draft_model))
        self.shadows: dict[str, Sequence] = {}
        self.lost: set[str] = set()       # requests whose target computed past a gap in the drafter's context
        self.waiting: dict[str, list[tuple[int, torch.Tensor]]] = {}   # per request, (start, features) not written

    def attach(self, seq: Sequence, root_key: bytes | None) -> None:
        shadow = Sequence(seq.request_id, seq.token_ids, seq.params, None, seq.arrival)
        shadow.kv = self.kv.new_state(seq.request_id, shadow.token_ids, len(seq.token_ids) + seq.params.max_tokens,
                                      root_key)
        self.shadows[seq.request_id] = shadow

    def observe(self, seq: Sequence, start: int, features: torch.Tensor) -> None:
        """The target computed the sequence's tokens from `start` to its num_computed_tokens, these rows' features
        [rows, F] (a verify step's rejected rows among them, past num_computed_tokens): the drafter's K/V there,
        written when it is needed (`_write_waiting`)."""
        shadow = self.shadows.get(seq.request_id)
        if shadow is None or seq.request_id in self.lost:
            return
        try:
            if not self._admitted(seq, shadow):
                return
            if seq.kv.residency and seq.kv.residency.bounded_from is not None:
                # the model's K/V, and so the features, from there on came from its window: so do the drafter's
                # (marked now: the model's residency is reset when it ends, before the rows waiting are written)
                self.kv.mark_bounded(shadow.kv, seq.kv.residency.bounded_from)
        except Exception:
            self._failed(seq)
            return
        waiting = self.waiting.setdefault(seq.request_id, [])
        # a copy: a view would keep the whole step's features (every sequence's rows) alive while it waits
        waiting.append((start, features[:max(0, seq.num_computed_tokens - start)].clone()))
        if sum(len(f) for _, f in waiting) >= WRITE_AFTER:
            self._write_waiting(seq)

    def _failed(self, seq: Sequence) -> None:
        """The drafter failed for the request: it costs it its proposals, never its answer."""
        log.exception("request %s: the DFlash drafter failed: no proposals for it", seq.request_id)
        self.lost.add(seq.request_id)

    def _admitted(self, seq: Sequence, shadow: Sequence) -> bool:
        """Its shadow admitted (its cached prefix held in the drafter's pool from the first step on), or the request
        lost."""
        if shadow.status is not SequenceStatus.RUNNING:
            _catch_up(shadow, seq)
            admitted = self.kv.admit(shadow.kv, 0)
            if admitted is not None:
                shadow.status, shadow.num_computed_tokens = SequenceStatus.RUNNING, admitted[0]
        if shadow.status is not SequenceStatus.RUNNING:
            log.warning("request %s: the DFlash drafter's pool or host budget has no room: no proposals for it",
                        seq.request_id)
            self.lost.add(seq.request_id)
        return seq.request_id not in self.lost

    def _write_waiting(self, seq: Sequence) -> None:
        """Write the drafter's K/V from the features the sequence has waiting, runs of consecutive rows in one
        forward each."""
        start = time.perf_counter()
        shadow, waiting = self.shadows.get(seq.request_id), self.waiting.pop(seq.request_id, [])
        runs, end = [], None      # (start, its parts); where the last run ends
        for first, features in waiting:
            if first == end:
                runs[-1][1].append(features)
            else:
                runs.append((first, [features]))
            end = first + len(features)
        try:
            for first, parts in runs:
                if shadow is None or seq.request_id in self.lost:
                    return
                self._write(seq, shadow, first, torch.cat(parts))
        except Exception:
            self._failed(seq)
        finally:
            self.writing += time.perf_counter() - start

    def _write(self, seq: Sequence, shadow: Sequence, start: int, features: torch.Tensor) -> None:
        """The drafter's K/V of tokens start .. start + len(features) - 1."""
        _catch_up(shadow, seq)
        end = start + len(features)
        if not start <= shadow.num_computed_tokens or shadow.kv.compute_first:
            log.info("request %s: the DFlash drafter holds %d of the %d tokens the model had cached: no proposals "
                     "for it", seq.request_id, shadow.num_computed_tokens, start)
            self.lost.add(seq.request_id)     # a gap: the features before `start` are nowhere
            return
        first, bs = shadow.num_computed_tokens, self.pool.block_size
        while first < end:      # in pieces its residency budget holds, as the model's prompt chunks are
            last = first + self.kv.chunk(shadow.kv, first, end - first)
            if last == first or not self.kv.reserve(shadow.kv, last):
                log.warning("request %s: the DFlash drafter's pool is full: no proposals for it", seq.request_id)
                self.lost.add(seq.request_id)
                return
            positions = torch.arange(first, last, device=features.device)
            slots = torch.tensor([shadow.kv.block_table[p // bs] * bs + p % bs for p in range(first, last)],
                                 device=features.device)
            with torch.inference_mode():
                for i, (k, v) in enumerate(self.model.context_kv(features[first - start:last - start], positions)):
                    self.pool.k_cache[i].index_copy_(0, slots, k.to(self.pool.dtype))
                    self.pool.v_cache[i].index_copy_(0, slots, v.to(self.pool.dtype))
            shadow.num_computed_tokens = first = last
            self.kv.commit(shadow.kv, last, None, False, False)

    def propose(self, wanted: list[tuple[Sequence, int]], prefilling: list[Sequence]) -> float:
        """Set each sequence's draft (up to k tokens) from one block forward each. Returns the seconds the block
        forwards took: writing the rows that waited first is the drafter's own work (`writing`), not what the
        proposal costs (the prefilling sequences' drafter state is written from their own steps' features:
        `observe`)."""
        start, written = time.perf_counter(), self.writing
        for seq, k in wanted:
            shadow = self.shadows.get(seq.request_id)
            seq.draft = []
            if k > 0:
                self._write_waiting(seq)
            if k <= 0 or shadow is None or seq.request_id in self.lost or \
                    shadow.num_computed_tokens != len(seq.token_ids) - 1:
                continue
            seq.draft = self._block(shadow, seq, k)
        return time.perf_counter() - start - (self.writing - written)

    @torch.inference_mode()
    def _block(self, shadow: Sequence, seq: Sequence, k: int) -> list[int]:
        """The block's first k proposals (the LM head reads those rows only); a block shortened where it would pass
        the positions the drafter's RoPE covers."""
        n, bs = shadow.num_computed_tokens, self.pool.block_size
        size = min(self.block_size, len(self.model.rope.cos) - n)
        if size < 2:
            return []
        # its context where it is resident (under bounded residency a window: keys carry their positions' RoPE)
        slots = torch.cat([torch.arange(a, b) for a, b in slot_runs(shadow.kv.block_table, n, bs)])
        slots = slots.to(self.pool.device)
        context = [(self.pool.k_cache[i][slots], self.pool.v_cache[i][slots])
                   for i in range(len(self.model.layers))]
        device = self.pool.device
        ids = torch.tensor([seq.token_ids[-1]] + [self.mask_token_id] * (size - 1), device=device)
        embedded = self.target.model.embed_tokens(ids)
        hidden = self.model.block(embedded, torch.arange(n, n + size, device=device), context)
        return self.target.logits(hidden[1:k + 1]).argmax(-1).tolist()

    def preempted(self, seq: Sequence) -> None:
        """The target gave its blocks back; the drafter's state stays: it could not be computed again where the
        target's prefix comes back from its cache (no features for tokens it does not compute)."""

    def end(self, seq: Sequence) -> None:
        """The request finished: as the target's, its drafter state is kept for a next turn if it stopped or reached
        its length, else given back."""
        keep = seq.finish_reason in ("stop", "length")
        if keep:
            self._write_waiting(seq)
        self.waiting.pop(seq.request_id, None)
        shadow = self.shadows.pop(seq.request_id, None)
        self.lost.discard(seq.request_id)
        if shadow is None:
            return
        if shadow.status is SequenceStatus.RUNNING and keep:
            _catch_up(shadow, seq)
            self.kv.finish(shadow.kv)
        else:
            self.kv.release(shadow.kv)

    def shutdown(self) -> None:
        self.kv.shutdown()

    def stats(self) -> dict:
        return {**super().stats(), "lost_requests": len(self.lost)}


def _catch_up(shadow: Sequence, seq: Sequence) -> None:
    """The shadow's tokens up to the request's."""
    shadow.token_ids += seq.token_ids[len(shadow.token_ids):]
