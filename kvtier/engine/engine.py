"""The synchronous engine: add requests, step, collect outputs."""
from __future__ import annotations

import itertools
import logging
import os
import time

import torch

from kvtier.config import Config
from kvtier.devices import bind_thread
from kvtier.engine.detokenizer import IncrementalDetokenizer
from kvtier.engine.assembly import (build_pager, build_pool, build_tier_stack, decode_graphs, digest_cache,
                                    decodes_in_ggml, kv_manager, manifest_store, pool_tokens, tier_share)
from kvtier.engine.outputs import RequestOutput, RequestRejected
from kvtier.engine.runner import TORCH_THREADS, ModelRunner
from kvtier.engine.grammar import GrammarCompiler, GrammarError
from kvtier.engine.logits_processing import process_logits
from kvtier.engine.sampler import sample, token_logprobs
from kvtier.engine.sampling_params import SamplingParams
from kvtier.engine.scheduler import ScheduledBatch, Scheduler
from kvtier.engine.sequence import Sequence
from kvtier.engine.verify import choose
from kvtier.kv.keys import salt_root
from kvtier.kv.pager import CAPTURE_ROWS, PinRefused
from kvtier.models.decoder import Decoder, packs_weights
from kvtier.models.loader import hf_config, load_model, resolve_model_path
from kvtier.models.quantized import QuantizedLinear, model_weight_bytes
from kvtier.spec.dflash import DFlashDrafter, dflash_weight_bytes
from kvtier.spec.draft_model import DraftModel, load_draft, weight_bytes
from kvtier.spec.speculator import Speculator

log = logging.getLogger("kvtier.engine")


def context_length(asked: int | None, trained: int) -> int:
    """--max-model-len, or the model's context. Past the model's context it is taken as llama.cpp takes -c, with a
    warning: positions the model was never trained on rotate as any other (RoPE covers them) and its answers there
    may lose their way."""
    if asked and asked > trained:
        log.warning("--max-model-len %d is past the model's context of %d tokens: it was never trained on positions "
                    "beyond that, and its answers there may degrade", asked, trained)
    return asked or trained


class LLMEngine:
    def __init__(self, config: Config):
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = torch.device(config.device)
        bind_thread(self.device)      # the thread that builds the engine captures its graphs and warms it up
        digests = digest_cache(config)
        path = resolve_model_path(config.model)
        loaded = load_model(path, config.torch_dtype, digests, config.weights_mode(path), packs_weights(self.device))
        self.weights_mode = loaded.weights_mode     # what load_model did with the weights (--quantize)
        self.model_config = loaded.config
        self.model_name = loaded.name
        self.fingerprint = loaded.fingerprint
        self.tokenizer = loaded.tokenizer
        if config.chat_template:
            with open(config.chat_template) as f:
                self.tokenizer.use_chat_template(f.read())
        self.max_model_len = context_length(config.max_model_len, loaded.config.max_position_embeddings)
        # the model takes the weights it runs (fused, repacked) out of loaded.weights: the loaded copies are gone
        # before free memory sizes the pool
        self.model = Decoder.from_weights(loaded.config, loaded.weights, config.torch_dtype, self.device,
                                          positions=self.max_model_len)
        kinds = sorted({p.type_name for m in self.model.modules() if isinstance(m, QuantizedLinear) for p in m.parts})
        log.info("weights: %s, %.0f MB%s", self.weights_mode, model_weight_bytes(self.model) / 1e6,
                 f" ({', '.join(kinds)})" if kinds else "")
        mc = loaded.config
        dflash = config.speculative == "dflash"
        draft = load_draft(config, loaded, self.max_model_len) if config.speculative == "draft" else None
        drafter_path = config.draft_model and os.path.expanduser(config.draft_model)
        drafter_config = draft.config if draft else hf_config(drafter_path) if dflash else None
        # the drafter's pool holds as many tokens as the model's, from one budget; its weights are not on the device yet
        reserve = weight_bytes(draft.weights.values(), config.torch_dtype) if draft else \
            dflash_weight_bytes(drafter_path) if dflash else 0
        tokens = pool_tokens(config, [mc] + ([drafter_config] if drafter_config else []), self.device,
                             model_weight_bytes(self.model), reserve)
        self.pool = build_pool(config, mc, loaded.fingerprint, self.device, tokens,
                               values_transposed=decodes_in_ggml(config, self.model, self.device))
        # the drafter's part of the tiers' budgets
        share = tier_share(drafter_config, mc) if drafter_config else 0.0
        self.tiers = build_tier_stack(config, self.pool, self.max_model_len, 1 - share)
        self.pager = build_pager(config, self.pool, self.tiers, mc.head_dim, loaded.fingerprint) \
            if config.resident_blocks else None
        self.max_pinned_tokens = self.pager.max_pinned_tokens if self.pager else None
        manifests = self.pager and manifest_store(config, self.pager)
        self.kv = kv_manager(config, self.pool, self.tiers, self.pager, manifests)
        self.scheduler = Scheduler(self.kv, config.max_batched_tokens, config.max_num_seqs, config.max_itl_ratio)
        self.drafter = DraftModel(config, draft, share, self.device, tokens, self.max_model_len, mc.vocab_size) \
            if draft else DFlashDrafter(config, self.model, loaded.fingerprint, share, self.device, tokens,
                                        self.max_model_len) if dflash else None
        features = self.drafter.feature_layers if dflash else ()      # the layers a DFlash drafter reads
        self.runner = ModelRunner(self.model, self.kv, self.device,
                                  decode_graphs(config, self.model, self.pool, self.max_model_len, features),
                                  config.num_threads or TORCH_THREADS)
        self.runner.feature_layers = features
        self.grammars = GrammarCompiler(self.tokenizer.hf)
        lookup = (config.prompt_lookup_min, config.prompt_lookup_max)
        self.speculator = Speculator(config.speculative, config.num_speculative_tokens, lookup) \
            if config.speculative else None
        self._arrivals = itertools.count()
        self._ended: list[Sequence] = []     # finished outside a step (aborted, failed): reported by the next step

    def check_request(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Raise RequestRejected if this request could never run. Reads only fixed state: thread-safe."""
        if num_prompt_tokens == 0:
            raise RequestRejected("the prompt is empty")
        if params.logit_bias and max(params.logit_bias) >= self.model_config.vocab_size:
            raise RequestRejected(f"logit_bias names token {max(params.logit_bias)}, but the vocabulary has "
                                  f"{self.model_config.vocab_size} tokens")
        total = num_prompt_tokens + params.max_tokens
        if total > self.max_model_len:
            raise RequestRejected(
                f"this model's maximum context length is {self.max_model_len} tokens, but the request needs "
                f"{total} ({num_prompt_tokens} in the prompt + {params.max_tokens} max_tokens); "
                "shorten the prompt or lower max_tokens")
        blocks = self.pool.blocks_for(total)
        if self.pager:
            self._check_paged_out_room(self.pager.host_bytes_for(total))
            blocks = min(blocks, self.pager.budget_blocks)
        if blocks > self.pool.num_blocks:
            raise RequestRejected(
                f"the request needs {blocks * self.pool.block_size} tokens of device KV but the whole pool holds "
                f"{self.pool.num_blocks * self.pool.block_size}; raise --kv-pool-tokens or shorten the request")

    def _check_paged_out_room(self, need: int) -> None:
        room = self.tiers.pinnable_bytes
        if need > room:
            raise RequestRejected(
                f"the request would page {need / 2**30:.2f} GiB of KV out to the host tier, whose blocks may take "
                f"{room / 2**30:.2f} GiB; raise --kv-host-gib or shorten the request")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    pins: list[tuple[int, int]] | None = None, cache_salt: str | None = None) -> None:
        """pins: half-open token ranges of the prompt kept resident under bounded residency.
        cache_salt: the request shares KV only with requests of the same salt."""
        self.check_request(len(prompt_token_ids), params)
        if pins and not self.pager:
            raise RequestRejected("pins keep prompt ranges resident under bounded residency, which this server "
                                  "does not run (start it with --kv-resident-tokens)")
        detok = IncrementalDetokenizer(self.tokenizer, params.stop)
        seq = Sequence(request_id, prompt_token_ids, params, detok, next(self._arrivals))
        if self.speculator:
            seq.spec = self.speculator.new_state()
        if params.grammar is not None:
            try:
                seq.constraint = self.grammars.constraint(params.grammar)
            except GrammarError as e:
                raise RequestRejected(str(e)) from None
        try:
            seq.kv = self.kv.new_state(request_id, seq.token_ids, len(prompt_token_ids) + params.max_tokens,
                                       salt_root(cache_salt), pins)
        except PinRefused as e:
            raise RequestRejected(str(e)) from None
        if self.drafter:
            self.drafter.attach(seq, salt_root(cache_salt))
        self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> None:
        seq = self.scheduler.find(request_id)
        if seq is None or self.kv.abort(seq.kv):
            return    # a loading request is reported when its load has landed and its blocks are free
        self.scheduler.finish(seq, "abort")
        self._ended.append(seq)

    def has_unfinished(self) -> bool:
        # pinned blocks count until their copy lands
        return self.scheduler.has_unfinished() or bool(self._ended) or self.kv.busy or \
            bool(self.drafter and self.drafter.kv.busy)

    def shutdown(self) -> None:
        """Stop the transfer workers (after the copies already queued); free ggml's decode graphs."""
        self.kv.shutdown()
        if self.drafter:
            self.drafter.shutdown()
        self.runner.close()

    def step(self) -> list[RequestOutput]:
        for state in self.kv.poll():       # loads aborted meanwhile, now released
            seq = self.scheduler.find(state.request_id)
            if seq is not None:       # not failed meanwhile
                self._end(seq, "abort")
        self.kv.start_loads([seq.kv for seq in self.scheduler.waiting])
        # graphs built for new step shapes are one-offs: left out of what the pacer, the speculator and the rates
        # learn (a first verify step of k rows would otherwise teach the speculator that k rows cost a decode step
        # more than they do); a draft model's rounds come back without its own (`drafting`)
        model_built, draft_built = self.runner.build_seconds, self.drafter.build_seconds if self.drafter else 0.0
        proposing = time.perf_counter()
        drafting = self._propose() if self.speculator else 0.0
        proposing = time.perf_counter() - proposing     # a drafter's rounds and its catch-up prefill too
        proposing -= self.drafter.build_seconds - draft_built if self.drafter else 0.0
        batch = self.scheduler.schedule()
        if self.drafter:
            for seq in batch.preempted:
                self.drafter.preempted(seq)
        writing = self.drafter.writing if self.drafter else 0.0
        start = time.perf_counter()
        results = self._forward(batch) if batch else []
        due = []       # sequences whose next token is to be sampled, with their logits
        verified = []  # sequences whose verify step appended their tokens
        features = self.runner.features if len(self.runner.features or ()) == len(results) else None
        for i, (seq, n, result) in enumerate(zip(batch.seqs, batch.num_tokens, results)):
            try:
                if result is None:
                    raise RuntimeError("the model forward failed for this request")
                logits, queries = result
                first, verifying, ends, sampling = seq.num_computed_tokens, seq.num_drafted(n), None, False
                if verifying:
                    ends = self._verify(seq, n, logits, queries)
                else:
                    sampling = self._advance(seq, n, queries)
                if features is not None:      # the DFlash drafter's state over what the step computed
                    self.drafter.observe(seq, first, features[i])
                if ends:      # after the drafter saw the step: finishing gives the sequence's residency back
                    self.scheduler.finish(seq, ends)
                # listed for output last: a sequence failed above is output once, as failed
                if verifying:
                    verified.append(seq)
                elif sampling:
                    due.append((seq, self._processed(seq, logits[-1]), logits[-1]))
            except Exception as e:     # it belongs to this request: fail it alone, the others go on
                self._fail(seq, e)
        outputs = [self._output(seq) for seq in self._append_tokens(due) + verified]
        seconds = time.perf_counter() - start - (self.runner.build_seconds - model_built)   # sampling synchronized
        # the DFlash drafter writing rows that waited (WRITE_AFTER of them, or a request's end) is its own work,
        # whatever the step computed: not the model's rate, nor what draft rows cost; the streams wait for it all
        computing = seconds - (self.drafter.writing - writing if self.drafter else 0.0)
        prompt_tokens = sum(batch.num_tokens) - batch.num_decodes - batch.num_drafted
        if prompt_tokens:    # a prefill step: the rate of compute
            self.kv.rates.observe_prefill(sum(batch.num_tokens), computing)
        if batch:      # a verify step counts as the decode it is, at what it cost, the drafter's work included
            self.scheduler.pacer.observe(batch.num_decodes, prompt_tokens, seconds + proposing)
        if self.speculator and batch and not prompt_tokens:       # what a draft row costs, its rounds included
            self.speculator.observe_step(batch.num_decodes, batch.num_drafted,
                                         computing + (drafting if batch.num_drafted else 0.0))
        self.runner.restore_threads()
        outputs += [self._output(seq) for seq in self._ended]
        self._ended.clear()
        if not batch and not outputs and self.kv.busy:
            self.kv.wait(timeout=0.05)   # nothing to compute: sleep until a copy lands
        elif not batch and not outputs and self.drafter and self.drafter.kv.busy:
            self.drafter.kv.wait(timeout=0.05)
        return outputs

    def _forward(self, batch: ScheduledBatch) -> list[tuple[torch.Tensor, torch.Tensor | None] | None]:
        """Per sequence: (its logits [rows, vocab], its captured queries). If the batch's forward fails, each
        sequence is run alone, so a failure that belongs to one request (None) does not fail the others."""
        capture = [CAPTURE_ROWS if seq.kv.residency else 0 for seq in batch.seqs]
        try:
            logits, queries = self.runner.run(batch, capture)
            return list(zip(logits, queries))
        except Exception:
            log.exception("a forward of %d sequences failed", len(batch.seqs))
            if len(batch.seqs) == 1:
                return [None]
        results = []
        for seq, n, wanted in zip(batch.seqs, batch.num_tokens, capture):
            try:   # the retry rewrites the same pool slots with the same K/V
                logits, queries = self.runner.run(ScheduledBatch([seq], [n]), [wanted])
                results.append((logits[0].clone(), queries[0]))     # its rows (a decode graph's own memory)
            except Exception:
                results.append(None)
        return results

    def _propose(self) -> float:
        """The draft of each sequence whose next step feeds a generated token. A bounded sequence's draft stays
        in its last block: a new block would page a victim out before a decode step would. Returns the seconds a
        draft model's decode rounds took."""
        decoding = [seq for seq in self.scheduler.running if seq.num_uncomputed_tokens == 1
                    and seq.num_computed_tokens >= seq.num_prompt_tokens]
        bs = self.pool.block_size
        rooms = []
        for seq in decoding:
            room = seq.params.max_tokens - seq.num_output_tokens - 1
            if seq.kv.residency:      # and its rows' queries are all handed back for the pager
                room = min(room, bs - 1 - seq.num_computed_tokens % bs, CAPTURE_ROWS - 1)
            rooms.append(room)
        if self.speculator.measure_now():      # this step only decodes: what a decode step costs now
            rooms = [0] * len(decoding)
        if self.drafter:
            decoding_now = set(decoding)
            prefilling = [seq for seq in self.scheduler.running if seq not in decoding_now]
            try:
                self.drafter.poll(list(self.scheduler.waiting))
                return self.drafter.propose([(seq, self.speculator.plan(seq.spec, room, len(decoding)))
                                             for seq, room in zip(decoding, rooms)], prefilling)
            except Exception:      # a drafter's failure costs this step its proposals, never a request its answer
                log.exception("the drafter failed: this step decodes without proposals")
                for seq in decoding:
                    seq.draft = []
                return 0.0
        for seq, room in zip(decoding, rooms):
            seq.draft = self.speculator.propose(seq.spec, seq.token_ids, room, len(decoding))
        return 0.0

    def _verify(self, seq: Sequence, n: int, logits: torch.Tensor, queries: torch.Tensor | None) -> str | None:
        """A verify step computed the sequence's last token and n - 1 draft tokens after it (logits [n, vocab]):
        the target's token at each row is taken while it is the draft's, then one more of its own. Only the
        accepted tokens' K/V count as computed: they alone are sealed and saved, and the blocks reserved for the
        rest are given back. A bounded sequence commits row by row, as its decode steps would, with each row's
        queries: once the pager moves blocks, the rows after it attended to a resident set the decode steps would
        not have, and end the step as a rejection would. Returns why the sequence ends, if it does (the caller
        finishes it)."""
        draft, start, reason, accepted = seq.draft, seq.num_computed_tokens, None, 0
        seq.draft = []
        bounded = seq.kv.residency is not None
        for j, row in enumerate(logits):
            moved = bounded and self.kv.commit(seq.kv, start + j + 1, queries[j:j + 1], False, True)
            proposed = draft[j] if j < len(draft) else None
            token = choose(self._processed(seq, row), seq.params, seq.generator)
            if seq.params.logprobs is not None:
                seq.pending_logprobs += token_logprobs(row[None], [token], [seq.params.logprobs])
            reason = self._take_token(seq, token)
            accepted += token == proposed
            if token != proposed or reason or moved:
                break
        seq.num_computed_tokens = len(seq.token_ids) - 1     # all but the last token taken, as after a decode
        if not bounded:
            self.kv.commit(seq.kv, seq.num_computed_tokens, None, False, True)
        self.kv.truncate(seq.kv, len(seq.token_ids))
        # a stop, or the pager, may end the step on an accepted token: that is not a rejection
        self.speculator.verified(seq.spec, len(draft), accepted, rejected=token != proposed and proposed is not None)
        return reason

    def _advance(self, seq: Sequence, n: int, queries: torch.Tensor | None) -> bool:
        """Account for n computed tokens; True when the next token is to be sampled (the prompt is done or the
        last token was fed)."""
        decoded = seq.num_uncomputed_tokens == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens
        seq.num_computed_tokens += n
        prompt_done = seq.num_uncomputed_tokens == 0 and not decoded
        self.kv.commit(seq.kv, seq.num_computed_tokens, queries, prompt_done, decoded)
        return seq.num_uncomputed_tokens == 0

    def _processed(self, seq: Sequence, logits: torch.Tensor) -> torch.Tensor:
        """The logits the sequence samples from: after its parameters and its grammar."""
        processed = process_logits(logits, seq.params, seq.token_ids, seq.num_prompt_tokens,
                                   self.tokenizer.eos_token_ids)
        return processed if seq.constraint is None else seq.constraint.masked(processed)

    def _append_tokens(self, due: list[tuple[Sequence, torch.Tensor, torch.Tensor]]) -> list[Sequence]:
        """Sample the due sequences' next tokens in one batch and append them; returns the sequences that got one.
        If the batch fails, each sequence samples alone, so a failure that belongs to one request fails only it."""
        if not due:
            return []
        seqs = [seq for seq, _, _ in due]
        try:
            # one row needs no copy: a stack's fresh memory costs its page faults (~0.1 ms a decode step on CPU)
            rows = due[0][1][None] if len(due) == 1 else torch.stack([p for _, p, _ in due])
            tokens = sample(rows, [s.params for s in seqs], [s.generator for s in seqs])
        except Exception:
            tokens = []
            for seq, processed, _ in due:
                try:
                    tokens += sample(processed[None], [seq.params], [seq.generator])
                except Exception as e:
                    tokens.append(None)
                    self._fail(seq, e)
        sampled = [(seq, token, raw) for (seq, _, raw), token in zip(due, tokens) if token is not None]
        wanted = [(seq, token, raw) for seq, token, raw in sampled if seq.params.logprobs is not None]
        logprobs = token_logprobs(torch.stack([raw for _, _, raw in wanted]), [t for _, t, _ in wanted],
                                  [seq.params.logprobs for seq, _, _ in wanted]) if wanted else []
        for (seq, _, _), logprob in zip(wanted, logprobs):
            seq.pending_logprobs.append(logprob)
        done = []
        for seq, token, _ in sampled:
            try:
                self._append_token(seq, token)
                done.append(seq)
            except Exception as e:     # its grammar refused the token, say: this request alone fails
                self._fail(seq, e)
        return done

    def _fail(self, seq: Sequence, error: Exception) -> None:
        log.error("request %s failed", seq.request_id, exc_info=error)
        seq.error = f"the server failed while generating ({type(error).__name__}: {error})"
        self._end(seq, "error")

    def _end(self, seq: Sequence, reason: str) -> None:
        """Finished outside a step's sampling (aborted, failed): reported by this or the next step."""
        self.scheduler.finish(seq, reason)
        self._ended.append(seq)

    def _append_token(self, seq: Sequence, token_id: int) -> None:
        if reason := self._take_token(seq, token_id):
            self.scheduler.finish(seq, reason)

    def _take_token(self, seq: Sequence, token_id: int) -> str | None:
        """Append a chosen token; returns why the sequence ends with it, if it does (the caller finishes it)."""
        params = seq.params
        if seq.constraint is not None:
            seq.constraint.accept(token_id)
        seq.token_ids.append(token_id)
        seq.pending_token_ids.append(token_id)
        if token_id in self.tokenizer.eos_token_ids and not params.ignore_eos:
            return "stop"
        if seq.detokenizer.add_token(token_id):
            return "stop"
        if seq.num_output_tokens >= params.max_tokens:
            return "length"
        if seq.constraint is not None and seq.constraint.done:
            return "stop"
        return None

    def _output(self, seq: Sequence) -> RequestOutput:
        out = RequestOutput(
            request_id=seq.request_id,
            new_token_ids=seq.pending_token_ids,
            new_text=seq.detokenizer.release(seq.is_finished),
            logprobs=seq.pending_logprobs if seq.params.logprobs is not None else None,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_cached_tokens=seq.kv.num_cached_tokens,
            num_output_tokens=seq.num_output_tokens,
            error=seq.error,
            stop_string=seq.detokenizer.matched_stop,
        )
        seq.pending_token_ids, seq.pending_logprobs = [], []
        if seq.is_finished:
            self._log_finished(seq)
            if self.drafter:
                self.drafter.end(seq)
        return out

    def _log_finished(self, seq: Sequence) -> None:
        tiers = ", ".join(f"{n} from {tier}" for tier, n in seq.kv.tier_tokens.items() if n)
        spec = seq.spec
        accepted = f" ({spec.accepted} of {spec.proposed} proposed tokens accepted in {spec.verify_steps} verify " \
                   f"steps)" if spec else ""
        log.info("request %s %s: %d prompt tokens (%s, %d computed), %d generated%s", seq.request_id,
                 seq.finish_reason, seq.num_prompt_tokens, tiers or "none cached",
                 seq.num_prompt_tokens - seq.kv.num_cached_tokens, seq.num_output_tokens, accepted)

    def stats(self) -> dict:
        stats = {"num_blocks": self.pool.num_blocks, "num_free_blocks": self.pool.num_free_blocks,
                 "num_cached_blocks": self.pool.num_cached_blocks, "block_size": self.pool.block_size,
                 "num_running": len(self.scheduler.running), "num_waiting": len(self.scheduler.waiting)}
        stats.update(self.kv.stats())
        if self.speculator:
            stats["speculation"] = self.speculator.stats()
        if self.drafter:
            stats["speculation"]["drafter"] = self.drafter.stats()
        if self.pager:
            stats["residency"] = {**self.pager.stats, "host_reserved_bytes": self.pager.host_reserved}
        return stats
