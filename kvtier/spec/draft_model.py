"""`--speculative draft --draft-model PATH`: a smaller model with the target's tokenizer proposes each decoding
sequence's next tokens by decoding them greedily itself.

The draft model is served as the target is: its own pool, whose namespace says "draft" (its blocks never share a
key with the target's, even when it is the same model), its own KV manager over its own host and disk tiers (in the
same directory, with a share of their budgets), and its own runner (ggml decode graphs on CPU with quantized
weights, CUDA graphs on a GPU). So its KV is content-addressed like the target's: a prefix it computed in an
earlier turn, before an eviction or before a restart is restored from the tiers, and a restored conversation
proposes from its first decode step with what the uninterrupted one would have.

Each sequence has a shadow: a Sequence over the target's tokens but the last (its own list, which the draft's KV
manager hashes), whose `draft` is the target's last token and then the tokens it proposes. A proposal:
1. sync: the shadow takes the target's new tokens; of its K/V, what follows the target's last token was computed
   for proposals, and only the accepted ones' stays (the first `len(target) - 1` positions): the rest is given back
   and only blocks of the target's tokens are ever sealed and saved;
2. catch up: a shadow far behind (its prompt) prefills its own tokens in chunks, at most `max_batched_tokens` a
   step over all shadows, while its sequence prefills its own; it proposes once it is within CATCH_UP_ROWS of the
   end;
3. rounds: the first feeds the rest of its own tokens and the target's last one as decode rows, each later one the
   token proposed before; each takes the argmax of its last row. Every shadow of the step decodes in one batch.
"""
from __future__ import annotations

import logging
import os
import time

import torch

from kvtier.config import Config
from kvtier.engine.assembly import build_kv, build_pool, decode_graphs, decodes_in_ggml, digest_cache
from kvtier.engine.runner import TORCH_THREADS, ModelRunner
from kvtier.engine.scheduler import ScheduledBatch
from kvtier.engine.sequence import Sequence, SequenceStatus
from kvtier.kv.state import NOT_RESIDENT
from kvtier.models.decoder import Decoder, packs_weights
from kvtier.models.loader import LoadedModel, load_model
from kvtier.models.packed import packable, packed_bytes
from kvtier.models.quantized import QuantizedWeight
from kvtier.spec.drafter import ShadowDrafter

log = logging.getLogger("kvtier.spec")

CATCH_UP_ROWS = 8      # a shadow this close to the end feeds the rest as decode rows of its first round


def load_draft(config: Config, target: LoadedModel, max_model_len: int) -> LoadedModel:
    """The draft model's weights, checked against the target's tokenizer (a draft proposes token ids); it decodes
    wherever the target does, past its own context too (with a warning)."""
    path = os.path.expanduser(config.draft_model)
    loaded = load_model(path, config.torch_dtype, digest_cache(config), config.weights_mode(path),
                        packs_weights(torch.device(config.device)))
    if loaded.tokenizer.hf.get_vocab() != target.tokenizer.hf.get_vocab():
        raise ValueError(f"the draft model {config.draft_model} has another tokenizer than the model it drafts for: "
                         "its proposals would be other tokens")
    if loaded.config.max_position_embeddings < max_model_len:
        log.warning("the draft model %s was trained on %d tokens of context, the model serves %d: past that it "
                    "still proposes (its RoPE covers every position) and the model checks each proposal, but fewer "
                    "may be accepted", config.draft_model, loaded.config.max_position_embeddings, max_model_len)
    return loaded


def weight_bytes(weights, dtype: torch.dtype) -> int:
    """What a draft model's weights take on a GPU: floats as loaded; quantized blocks packed (packed.py), or
    dequantized to dtype where no kernel multiplies their type."""
    def size(w) -> int:
        if isinstance(w, QuantizedWeight):
            return packed_bytes(w.ggml_type, w.nbytes) if packable(w.ggml_type) else \
                w.out_features * w.in_features * dtype.itemsize
        return w.nbytes
    return sum(size(w) for w in weights)


class DraftModel(ShadowDrafter):
    def __init__(self, config: Config, loaded: LoadedModel, share: float, device: torch.device, pool_tokens: int,
                 max_model_len: int, vocab_size: int):
        """share: of the host and disk budgets; pool_tokens: as many as the target's pool holds, so that every
        sequence the target runs fits; vocab_size: the target's (a draft's padded rows are never proposed)."""
        self.model = Decoder.from_weights(loaded.config, loaded.weights, config.torch_dtype, device,
                                          positions=max_model_len)
        self.pool = build_pool(config, loaded.config, loaded.fingerprint, device, pool_tokens, "draft",
                               decodes_in_ggml(config, self.model, device))
        self.kv = build_kv(config, self.pool, max_model_len, share, loaded.config.head_dim, loaded.fingerprint,
                           prompt_chunks=True)
        self.runner = ModelRunner(self.model, self.kv, device, decode_graphs(config, self.model, self.pool,
                                                                             max_model_len),
                                  config.num_threads or TORCH_THREADS)
        self.catch_up_tokens = config.max_batched_tokens
        self.vocab_size = vocab_size
        self.name = loaded.name
        self.shadows: dict[str, Sequence] = {}

    def attach(self, seq: Sequence, root_key: bytes | None) -> None:
        """A new request: its shadow, waiting to be admitted when it first proposes."""
        shadow = Sequence(seq.request_id, seq.token_ids[:-1], seq.params, None, seq.arrival)
        shadow.num_prompt_tokens = seq.num_prompt_tokens
        shadow.kv = self.kv.new_state(seq.request_id, shadow.token_ids, len(seq.token_ids) + seq.params.max_tokens,
                                      root_key)
        self.shadows[seq.request_id] = shadow

    def propose(self, wanted: list[tuple[Sequence, int]], prefilling: list[Sequence]) -> float:
        """Set each decoding sequence's draft: up to k tokens for each (sequence, k); the shadows of those and then
        of the prefilling ones catch up meanwhile (a prompt's draft prefill goes with its own). Returns the seconds
        the rounds took: what proposing costs each step (catching up is a prompt's cost, paid once; so is building a
        decode graph for a new round shape)."""
        shadows = {}
        for seq, k in wanted:
            shadow = self.shadows[seq.request_id]
            self._sync(shadow, seq)
            if k > 0:
                shadows[seq.request_id] = (shadow, k)
        for seq in prefilling:
            self._sync(self.shadows[seq.request_id], seq)
        ready = self._catch_up([shadow for shadow, _ in shadows.values()] +
                               [self.shadows[seq.request_id] for seq in prefilling])
        start, built = time.perf_counter(), self.build_seconds
        rounds = {seq.request_id: shadows[seq.request_id] for seq, _ in wanted if seq.request_id in ready}
        while rounds:
            batch = ScheduledBatch()
            for shadow, _ in rounds.values():
                n = len(shadow.token_ids) + len(shadow.draft) - shadow.num_computed_tokens
                if self.kv.reserve(shadow.kv, shadow.num_computed_tokens + n):
                    if NOT_RESIDENT in shadow.kv.block_table:     # its rows attend to a window (bounded residency)
                        self.kv.mark_bounded(shadow.kv, shadow.num_computed_tokens)
                    batch.add(shadow, n)
            if not batch:
                break
            logits, _ = self.runner.run(batch)
            for shadow, n, rows in zip(batch.seqs, batch.num_tokens, logits):
                shadow.num_computed_tokens += n
                shadow.draft.append(int(rows[-1, :self.vocab_size].argmax()))
            rounds = {rid: (shadow, k) for rid, (shadow, k) in rounds.items()
                      if shadow in batch.seqs and len(shadow.draft) <= k}
        self.runner.restore_threads()
        for seq, k in wanted:
            seq.draft = self.shadows[seq.request_id].draft[1:1 + k]
        return time.perf_counter() - start - (self.build_seconds - built)

    @property
    def build_seconds(self) -> float:
        return self.runner.build_seconds

    def _sync(self, shadow: Sequence, seq: Sequence) -> None:
        """The target's tokens but its last, and of the K/V computed, that of accepted tokens only."""
        shadow.token_ids += seq.token_ids[len(shadow.token_ids):-1]
        shadow.draft = [seq.token_ids[-1]]
        if shadow.status is not SequenceStatus.RUNNING:
            return
        shadow.num_computed_tokens = min(shadow.num_computed_tokens, len(shadow.token_ids))
        self.kv.commit(shadow.kv, shadow.num_computed_tokens, None, False, False)
        self.kv.truncate(shadow.kv, len(seq.token_ids))

    def _catch_up(self, shadows: list[Sequence]) -> set[str]:
        """Admit the shadows not yet running and prefill those far behind, within the step's catch-up budget.
        Returns the request ids of those close enough to the end to propose now."""
        batch, budget = ScheduledBatch(), self.catch_up_tokens
        for shadow in shadows:
            if shadow.status is SequenceStatus.RUNNING:
                shadow.num_computed_tokens = self.kv.take_landed(shadow.kv, shadow.num_computed_tokens)
                behind = len(shadow.token_ids) - shadow.num_computed_tokens
                n = self.kv.chunk(shadow.kv, shadow.num_computed_tokens, min(behind, budget))
                if behind < CATCH_UP_ROWS or n == 0 or not self.kv.reserve(shadow.kv, shadow.num_computed_tokens + n):
                    continue
            elif shadow.kv.waits_for_load or budget == 0 or (admitted := self.kv.admit(shadow.kv, budget)) is None:
                continue
            else:
                shadow.status = SequenceStatus.RUNNING
                shadow.num_computed_tokens, n = admitted
                if len(shadow.token_ids) - shadow.num_computed_tokens < CATCH_UP_ROWS:
                    continue      # its blocks are reserved: its first round feeds the rest
            batch.add(shadow, n)
            budget -= n
            if budget == 0:
                break
        if batch:
            self.runner.run(batch)
            for shadow, n in zip(batch.seqs, batch.num_tokens):
                shadow.num_computed_tokens += n
                self.kv.commit(shadow.kv, shadow.num_computed_tokens, None, False, False)
        return {s.request_id for s in shadows if s.status is SequenceStatus.RUNNING and not s.kv.compute_first
                and len(s.token_ids) - s.num_computed_tokens < CATCH_UP_ROWS}

    def preempted(self, seq: Sequence) -> None:
        """The target gave its blocks back: so does its shadow, which returns as the target does, through its
        sealed blocks (cached) or a prefill, so that the draft pool has room for the sequences that run meanwhile,
        as the target's pool has."""
        shadow = self.shadows[seq.request_id]
        if shadow.status is SequenceStatus.RUNNING:
            self.kv.release(shadow.kv)
            shadow.num_computed_tokens = 0
            shadow.status = SequenceStatus.WAITING

    def end(self, seq: Sequence) -> None:
        """The target sequence finished: a shadow that stopped or reached its length leaves its blocks (its last,
        partly filled one too) for the next turn, as the target does; any other gives them back (a load in flight
        frees them when it lands)."""
        shadow = self.shadows.pop(seq.request_id, None)
        if shadow is None:
            return
        if shadow.status is SequenceStatus.RUNNING and seq.finish_reason in ("stop", "length"):
            self._sync(shadow, seq)
            self.kv.finish(shadow.kv)
        else:
            self.kv.release(shadow.kv)

    def shutdown(self) -> None:
        self.kv.shutdown()
        self.runner.close()

