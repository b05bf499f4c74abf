"""Turns a scheduled batch into one model forward: flat token batch + attention metadata."""
from __future__ import annotations

from typing import NamedTuple

import torch

from kvtier.engine.graphs import DecodeGraphs
from kvtier.openmp import stop_spinning
from kvtier.engine.scheduler import ScheduledBatch
from kvtier.engine.sequence import Sequence
from kvtier.kv.manager import KVManager
from kvtier.kv.state import NOT_RESIDENT
from kvtier.models.attention import AttentionMetadata, DecodeGroup, PrefillSeq, resident_blocks, to_device
from kvtier.models.decoder import Decoder
from kvtier.models.ggml_decoder import GgmlDecodeSteps


def slot_runs(block_table: list[int], end: int, block_size: int) -> list[tuple[int, int]]:
    """Pool slot ranges [a, b) holding positions 0..end-1 of a sequence, consecutive blocks merged, blocks that are
    not resident left out."""
    runs = []
    for i, block in enumerate(block_table[:-(-end // block_size)]):
        if block == NOT_RESIDENT:
            continue
        a, b = block * block_size, block * block_size + min(block_size, end - i * block_size)
        if runs and runs[-1][1] == a:
            runs[-1] = (runs[-1][0], b)
        else:
            runs.append((a, b))
    return runs


def decodes(seq: Sequence, n: int) -> bool:
    """Whether a step of n tokens decodes the sequence: its one uncomputed token (a cached prompt's last token runs
    alone as well), or a verify step's, that token and a draft. A prompt chunk of one token short of its last is
    not one."""
    last = n == 1 and seq.num_computed_tokens > 0 and seq.num_computed_tokens + 1 >= len(seq.token_ids)
    return last or seq.num_drafted(n) > 0


def generates(seq: Sequence, n: int) -> bool:
    """Whether a decode step of n tokens feeds the sequence tokens the model generated or proposed, not a prompt
    token (a cached prompt's last token)."""
    return decodes(seq, n) and seq.num_computed_tokens >= seq.num_prompt_tokens


class GraphStep(NamedTuple):
    """Rows of one sequence that a step of the decode graphs runs: from position `start`, whether they are a
    prompt's last token (precise products) and whether their logits are wanted."""
    seq: int            # its place in the batch
    start: int
    rows: int
    precise: bool
    sampled: bool


# torch's own thread count, taken before any ggml decode step lowered it
TORCH_THREADS = torch.get_num_threads()
# A prompt whose part past what the cache held is at most SHORT_PROMPT_TOKENS tokens, and at most SHORT_PROMPT_KEYS
# of them times its length, runs that part in ggml's decode steps as rows beside the decodes: an agent's turn after a
# cached prefix (a tool's result, a reply). Eagerly, its rows would dequantize every weight for torch's product,
# whatever their count: on a 2-core Xeon 16 new tokens after a cached 1,024 took ~190 ms eagerly for the bundled
# model and ~1.16 s for a 1B Q4_K_M one, against 75 ms in the graph for the bundled model; a graph row costs ~2.8 ms
# there plus ~1.8 µs per key of its context, so past ~37 rows at 1K of context, ~17 at 4K and ~10 at 8K the eager
# forward is sooner (docs/BENCHMARKS.md, "Agent turns on quantized weights").
SHORT_PROMPT_TOKENS = 32
SHORT_PROMPT_KEYS = 32 * 2048
# A prompt with this many tokens or more past what the cache held attends in bfloat16 on CPU where its model's prompt
# rows multiply in it (`Decoder.prompt_attention_dtype`); fewer attend in float32, where their context is read as
# it lies: bfloat16 copies it, which for a few rows after a long context costs more than it saves (per layer of the
# bundled model at 30K tokens of context, 8 rows 14.4 ms against 10.0 in float32, 16 rows about even, 32 rows
# 18.6 against 21.7, 256 rows 77.8 against 95.4: docs/BENCHMARKS.md)
PROMPT_ATTENTION_TOKENS = 16


class ModelRunner:
    def __init__(self, model: Decoder, kv: KVManager, device: torch.device,
                 graphs: DecodeGraphs | GgmlDecodeSteps | None = None, torch_threads: int = TORCH_THREADS):
        """torch_threads: torch's CPU threads for the steps it runs (ggml's decode steps run torch on one)."""
        self.model = model
        self.kv = kv
        self.pool = kv.pool
        self.device = device
        self.graphs = graphs     # decode steps captured as CUDA graphs (or ggml's); None runs every step eagerly
        self.torch_threads = torch_threads
        self.feature_layers: tuple[int, ...] = ()    # layers whose outputs a drafter reads
        self.features: list[torch.Tensor] | None = None   # the last step's, per sequence [its rows, features]

    def _slots(self, block_table: list[int], start: int, end: int) -> torch.Tensor:
        """Pool slots of positions start..end-1 of a sequence, leaving out blocks that are not resident."""
        bs = self.pool.block_size
        blocks = torch.tensor(block_table[start // bs: -(-end // bs)], dtype=torch.long)
        offset = start // bs * bs
        slots = (blocks[:, None] * bs + torch.arange(bs)).flatten()[start - offset: end - offset]
        if (blocks == NOT_RESIDENT).any():
            slots = slots[(blocks != NOT_RESIDENT).repeat_interleave(bs)[start - offset: end - offset]]
        return slots

    def prepare(self, batch: ScheduledBatch, capture: list[int] | None = None
                ) -> tuple[torch.Tensor, AttentionMetadata, list[range]]:
        """Flat token ids, metadata, and per sequence the rows whose logits it may sample from: its last one, or
        a verify step's every row. capture[i]: how many of sequence i's last rows should hand back their
        queries."""
        token_ids, positions, slot_mapping, prefills, out_rows, capture_rows = [], [], [], [], [], []
        decode_rows, decode_runs, generated_rows, verify, alone_rows, last_prompt_rows = [], [], [], [], [], []
        bounded = []      # (prompt chunk, its sequence's KV state, its blocks before it): it attends to paged-out ones
        row = 0
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            token_ids += seq.step_tokens(start, n)
            positions += range(start, end)
            table = seq.kv.block_table
            slot_mapping.append(self._slots(table, start, end))
            if decodes(seq, n):       # each row attends as a decode of its own, up to its position
                decode_rows += range(row, row + n)
                if generates(seq, n):
                    generated_rows += range(row, row + n)
                elif n == 1 and self.device.type == "cpu":      # a cached prompt's last token
                    alone_rows.append(row)
                    last_prompt_rows.append(row)
                decode_runs += [slot_runs(table, start + j + 1, self.pool.block_size) for j in range(n)]
                if n > 1:
                    verify.append((len(decode_rows) - n, n, slot_runs(table, start, self.pool.block_size)))
            else:
                prefix = slot_runs(table, start, self.pool.block_size)
                alone = self._runs_last_alone(seq, n)      # AttentionMetadata.alone_rows
                prefills.append(PrefillSeq(row, n - alone, prefix, table[:self.pool.blocks_for(end)],
                                           dtype=self._attention_dtype(seq)))
                if alone:
                    decode_rows.append(row + n - 1)
                    decode_runs.append(slot_runs(table, end, self.pool.block_size))
                    alone_rows.append(row + n - 1)
                if self.device.type == "cpu" and end >= len(seq.token_ids):     # alone or not (a bounded sequence's)
                    last_prompt_rows.append(row + n - 1)
                if seq.kv.residency and start > 0:
                    bounded.append((prefills[-1], seq.kv, table[:start // self.pool.block_size]))
            row += n
            out_rows.append(range(row - n if seq.num_drafted(n) else row - 1, row))
            if capture and capture[i]:
                capture_rows += range(row - min(capture[i], n), row)
        if bounded:
            for (prefill, _, _), paged_out in zip(bounded, self.kv.paged_out_kv([(kv, b) for _, kv, b in bounded])):
                prefill.paged_out = paged_out
        meta = AttentionMetadata(
            positions=to_device(torch.tensor(positions, dtype=torch.long), self.device),
            slot_mapping=to_device(torch.cat(slot_mapping), self.device),
            prefills=prefills,
            decode=DecodeGroup(decode_rows, decode_runs, verify=verify) if decode_rows else None,
            generated_rows=generated_rows,
            alone_rows=alone_rows,
            last_prompt_rows=last_prompt_rows,
            capture_rows=to_device(torch.tensor(capture_rows, dtype=torch.long), self.device) if capture_rows else None,
            block_size=self.pool.block_size,
        )
        return to_device(torch.tensor(token_ids, dtype=torch.long), self.device), meta, out_rows

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, capture: list[int] | None = None
            ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """Forward the batch. Returns per sequence its logits [rows, vocab]: at its last scheduled token (zeros for
        a prompt chunk that does not end its prompt: nothing samples there), or at every token of a verify step;
        and per sequence its captured queries [rows, layers, heads, head_dim] (None where capture is 0). ggml's
        decode steps leave torch on one thread (`restore_threads` gives it back)."""
        capture = capture or [0] * len(batch.seqs)
        self.features = None
        graphed = self._graphed(batch, capture)
        tails = self._graph_tails(batch, graphed)
        if len(graphed) == len(batch.seqs):
            return self._run_graphs(batch, graphed, capture, {})
        if not graphed and not tails:
            return self._run_eagerly(batch, capture)
        # the eager sequences first, a prompt chunk without the rows the decode graphs take of it (which attend
        # over the chunk's K/V), then the decode graphs: a decode row's numerics never depend on the step, so
        # ggml's take a mixed step's decodes too
        eager = [i for i in range(len(batch.seqs)) if i not in graphed]
        part = ScheduledBatch()
        for i in eager:
            part.add(batch.seqs[i], batch.num_tokens[i] - tails.get(i, 0))
        eager_logits, eager_queries = self._run_eagerly(part, [capture[i] for i in eager])
        eager_features, self.features = self.features, None
        in_graphs = graphed + list(tails)
        graph_logits, graph_queries = self._run_graphs(batch, in_graphs, capture, tails)
        logits, queries = [None] * len(batch.seqs), [None] * len(batch.seqs)
        for part_of, part_logits, part_queries in ((eager, eager_logits, eager_queries),
                                                    (in_graphs, graph_logits, graph_queries)):
            for i, rows, q in zip(part_of, part_logits, part_queries):
                logits[i], queries[i] = rows, q     # a chunk's last token's logits: the graphs'
        if eager_features is not None and self.features is not None:     # each sequence's, in the batch's order
            features = [None] * len(batch.seqs)
            for part_of, rows in ((eager, eager_features), (in_graphs, self.features)):
                for i, f in zip(part_of, rows):
                    features[i] = f if features[i] is None else torch.cat([features[i], f])
            self.features = features
        return logits, queries

    def close(self) -> None:
        """Free ggml's decode graphs (their memory is ggml's, not torch's); later steps run eagerly."""
        if isinstance(self.graphs, GgmlDecodeSteps):
            self.graphs.close()
            self.graphs = None

    @property
    def build_seconds(self) -> float:
        """Seconds its decode graphs have taken to build, over its life: ggml's are built on a step shape's first
        use (9-21 ms each for the bundled model), CUDA's all at start."""
        return self.graphs.build_seconds if isinstance(self.graphs, GgmlDecodeSteps) else 0.0

    def restore_threads(self) -> None:
        """torch's own thread count back, after a step's sampling."""
        if torch.get_num_threads() != self.torch_threads:
            torch.set_num_threads(self.torch_threads)

    def _run_graphs(self, batch: ScheduledBatch, which: list[int], capture: list[int], tails: dict[int, int]
                    ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """Per sequence of `which`, its logits [rows, vocab] from the decode graphs, and its last capture[i] rows'
        queries [rows, layers, heads, head_dim] (ggml's graphs hand them back; CUDA's take no sequence that
        wants them). Those of `tails` run their chunk's last tails[i] rows only, after the rest of it (`_graph_tails`);
        a prompt's rows before its last token, whose logits nothing samples, then that token, which attends over
        them (`_graph_steps`)."""
        ggml_steps = isinstance(self.graphs, GgmlDecodeSteps)
        if ggml_steps and torch.get_num_threads() != 1:
            # torch's threads spin a while after each parallel region, on the cores ggml's threads need (12 ms a
            # step instead of 5.4 for SmolLM2 on 2 cores): the step's torch work (sampling) runs on one thread, and
            # the threads still spinning after this step's prompt chunk are stopped (openmp.py)
            torch.set_num_threads(1)
            stop_spinning()
        steps = self._graph_steps(batch, which, tails)
        if ggml_steps:      # a prompt's last token multiplies precisely in ggml's graphs, which take those rows last
            steps = [step for step in steps if not step.precise] + [step for step in steps if step.precise]
        inputs = self._decode_inputs(batch, [(step.seq, step.start, step.rows) for step in steps])
        rows = inputs[-1]
        if not ggml_steps:
            logits = self.graphs.run(*inputs).split(rows)
        else:
            sampled = [step.sampled for step in steps]
            some = any(sampled) and not all(sampled)      # else every row's logits (none wanted: a chunk's alone)
            logits = self.graphs.run(*inputs, precise=sum(step.precise for step in steps),
                                     sampled=sampled if some else None)
            logits = logits.split([n * wanted for n, wanted in zip(rows, sampled)] if some else rows)
        return self._per_sequence(steps, which, capture, logits)

    def _graph_steps(self, batch: ScheduledBatch, which: list[int], tails: dict[int, int]) -> list[GraphStep]:
        """What the graphs run of each sequence of `which`: a decode or a verify step whole; of a prompt chunk
        (whole, or its last tails[i] rows) its rows before the prompt's last token, then that token."""
        steps = []
        for i in which:
            seq, n = batch.seqs[i], batch.num_tokens[i]
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            if decodes(seq, n):
                steps.append(GraphStep(i, start, n, precise=n == 1 and not generates(seq, 1), sampled=True))
                continue
            first, ends = end - tails.get(i, n), end >= len(seq.token_ids)
            if end - ends > first:       # a short prompt's rows
                steps.append(GraphStep(i, first, end - ends - first, precise=False, sampled=False))
            if ends:
                steps.append(GraphStep(i, end - 1, 1, precise=True, sampled=True))
        return steps

    def _per_sequence(self, steps: list[GraphStep], which: list[int], capture: list[int],
                      logits: tuple[torch.Tensor, ...]) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """The graphs' outputs per sequence of `which`: its sampled step's logits (zeros for a short prompt's chunk
        that does not end it: nothing samples there), its captured queries, and into `features` its rows'
        features in order (a short prompt's rows, then its last token)."""
        features = self.graphs.features.split([step.rows for step in steps]) \
            if self.graphs.features is not None else [None] * len(steps)
        found_logits, found_features, found_queries, end = {}, {}, {}, 0
        for step, step_logits, step_features in zip(steps, logits, features):
            end += step.rows
            if step.sampled:
                found_logits[step.seq] = step_logits
            if capture[step.seq]:       # a bounded sequence's: one step of its own
                wanted = min(capture[step.seq], step.rows)
                found_queries[step.seq] = self.graphs.queries[:, end - wanted:end].transpose(0, 1).clone(
                    memory_format=torch.contiguous_format)
            if step_features is not None:
                earlier = found_features.get(step.seq)
                found_features[step.seq] = step_features if earlier is None else torch.cat([earlier, step_features])
        if self.graphs.features is not None:
            self.features = [found_features[i] for i in which]
        vocab = self.model.config.vocab_size
        # made only where missing: a fresh vocabulary-long row of zeros costs its page faults every step
        return [found_logits[i] if i in found_logits else torch.zeros(1, vocab) for i in which], \
            [found_queries.get(i) for i in which]

    def _run_eagerly(self, batch: ScheduledBatch, capture: list[int]) -> tuple[list[torch.Tensor], list]:
        self.restore_threads()
        token_ids, meta, out_rows = self.prepare(batch, capture)
        meta.feature_layers = self.feature_layers
        hidden = self.model(token_ids, self.pool.caches, meta)
        features = meta.stacked_features()
        if features is not None:
            self.features = list(features.split(batch.num_tokens))
        if any(seq.paged_out is not None for seq in meta.prefills):
            self.kv.forward_done()      # the gathered paged-out K/V it read may be overwritten after it
        queries = [None] * len(batch.seqs)
        if meta.capture_rows is not None:
            stacked = torch.stack(meta.captured, 1)          # [rows, layers, heads, head_dim]
            offset = 0
            for i, (n, wanted) in enumerate(zip(batch.num_tokens, capture)):
                if wanted:
                    rows = min(wanted, n)
                    queries[i] = stacked[offset:offset + rows]
                    offset += rows
        # logits where a token is sampled next: a decode or verify step, or the chunk that ends a prompt
        sampled = [i for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens))
                   if seq.num_computed_tokens + n >= len(seq.token_ids)]
        rows = [row for i in sampled for row in out_rows[i]]
        logits = [torch.zeros(1, self.model.config.vocab_size, device=hidden.device)] * len(batch.seqs)
        if rows:
            last = torch.tensor([row in meta.last_prompt_rows for row in rows], dtype=torch.bool)
            computed = self.model.logits(hidden[rows], last)
            for i, part in zip(sampled, computed.split([len(out_rows[i]) for i in sampled])):
                logits[i] = part
        return logits, queries

    def _graphed(self, batch: ScheduledBatch, capture: list[int]) -> list[int]:
        """The sequences whose step the decode graphs run: those decoding. CUDA graphs take a step of such decodes
        (and verify steps) only, whose rows a graph holds, none of whose queries the pager wants; ggml's decode steps
        take a mixed step's decodes too, bounded ones with them (they hand back their queries), so that every
        decode and verify row of quantized weights scores as any other would, and short prompts' chunks
        (SHORT_PROMPT_TOKENS) that start at or past what the cache held of their prompt."""
        if self.graphs is None:
            return []
        ggml_steps = isinstance(self.graphs, GgmlDecodeSteps)
        decoding = [i for i, (seq, n, wanted) in enumerate(zip(batch.seqs, batch.num_tokens, capture))
                    if decodes(seq, n) and (ggml_steps or not wanted)]
        if self.model.quantized:
            # a cached prompt's last token is a prompt row, which quantized weights multiply another way: ggml's steps
            # multiply it precisely, as after its chunk, unless bounded (whose cold run computes it inside its
            # chunk); CUDA's graphs take it not at all, nor does either take a draft model's catch-up round (the
            # rest of its prompt and a draft: decode rows, run op by op)
            decoding = [i for i in decoding if generates(batch.seqs[i], batch.num_tokens[i]) or
                        (ggml_steps and batch.num_tokens[i] == 1 and not batch.seqs[i].kv.residency)]
        if ggml_steps:      # and short prompts' chunks past what the cache held (SHORT_PROMPT_TOKENS); batch order
            return sorted(decoding + [i for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens))
                                      if not decodes(seq, n) and self._short_prompt(seq) and
                                      seq.num_computed_tokens >= seq.kv.held_tokens])
        rows = sum(batch.num_tokens[i] for i in decoding)
        return decoding if len(decoding) == len(batch.seqs) and self.graphs.bucket(rows) is not None else []

    def _short_prompt(self, seq: Sequence) -> bool:
        """Whether the sequence's prompt tokens past what the cache held of it (`KVState.held_tokens`) run in
        ggml's decode steps (SHORT_PROMPT_TOKENS): decided by what the cache held, never by how the scheduler cut
        the prompt, nor by whether compute-or-load restored the prefix or computed it again (then eagerly, before
        them), nor by when a load landed. Not a bounded sequence's: the pager's prompt chunks attend to paged-out
        blocks, which the graphs do not read."""
        uncached = len(seq.token_ids) - seq.kv.held_tokens
        return not seq.kv.residency and uncached <= SHORT_PROMPT_TOKENS and uncached * len(seq.token_ids) <= \
            SHORT_PROMPT_KEYS

    def _attention_dtype(self, seq: Sequence) -> torch.dtype | None:
        """The dtype the sequence's prompt chunks attend in on CPU (None: the activations' own): the model's
        `prompt_attention_dtype` where its prompt's part past what the cache held is PROMPT_ATTENTION_TOKENS or more
        (decided by what the cache held, as `_short_prompt` is, never by how the scheduler cut the prompt)."""
        if self.device.type != "cpu" or len(seq.token_ids) - seq.kv.held_tokens < PROMPT_ATTENTION_TOKENS:
            return None
        return self.model.prompt_attention_dtype

    def _graph_tails(self, batch: ScheduledBatch, graphed: list[int]) -> dict[int, int]:
        """Per prompt chunk the graphs do not take whole whose last rows ggml's decode steps run after the rest of
        it, those rows: a short prompt's past what the cache held (the chunk computes a held prefix again before
        them: `_short_prompt`), else the prompt's last token where it runs alone (`_runs_last_alone`)."""
        if not isinstance(self.graphs, GgmlDecodeSteps):
            return {}
        tails, graphed = {}, set(graphed)
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
            if i in graphed or decodes(seq, n):
                continue
            held, end = seq.kv.held_tokens, seq.num_computed_tokens + n
            if self._short_prompt(seq) and end > held:      # and it starts before: else the graphs take it whole
                tails[i] = end - held
            elif self._runs_last_alone(seq, n):
                tails[i] = 1
        return tails

    def _runs_last_alone(self, seq: Sequence, n: int) -> bool:
        """Whether a prompt chunk of n tokens ends its prompt with a token that runs alone after it, as it does when
        the rest of the prompt is cached (on CPU, unbounded): warm equals cold bitwise for the token sampled from
        it."""
        return self.device.type == "cpu" and n > 1 and seq.num_computed_tokens + n >= len(seq.token_ids) and \
            not seq.kv.residency

    def _decode_inputs(self, batch: ScheduledBatch, steps: list[tuple[int, int, int]]) -> tuple[list[int], ...]:
        """Per row of the steps (sequence i's n tokens from position start: one, or a verify step's several): its
        token, position and K/V slot; per step its context's resident blocks and length after it, and its rows'
        count."""
        bs = self.pool.block_size
        token_ids, positions, slots, tables, lens, rows = [], [], [], [], [], []
        for i, start, n in steps:
            seq = batch.seqs[i]
            table, end = seq.kv.block_table, start + n
            token_ids += seq.step_tokens(start, n)
            positions += range(start, end)
            slots += [table[pos // bs] * bs + pos % bs for pos in range(start, end)]
            blocks, length = table[:-(-end // bs)], end
            if NOT_RESIDENT in blocks:     # holes (bounded residency) are left out
                blocks, length = resident_blocks(slot_runs(table, end, bs), bs)
            tables.append(blocks)
            lens.append(length)
            rows.append(n)
        return token_ids, positions, slots, tables, lens, rows
