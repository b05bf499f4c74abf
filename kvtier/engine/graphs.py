"""Decode steps replayed from CUDA graphs, one per batch-size bucket and split count, captured at start-up.

An eager decode step launches hundreds of small kernels (per layer: norms, projections,
RoPE, the K/V write, attention, the MLP), so at small batches the CPU, not the GPU, sets
its pace. A graph replays them all with one launch. It reads its inputs from fixed
buffers: each step writes its token ids, positions, K/V slots, block tables and context
lengths into one pinned buffer, copies that to the device in one transfer, and replays the
smallest bucket that holds the batch. Padding rows decode token 0 at position 0 into the
pool's pad slot, which no sequence owns. Attention is the Triton decode kernel: its grid is
the bucket and context lengths are numbers in a buffer, so one graph serves every length up to
its bucket of context length. The kernel splits each context into parts (flash-decoding) by its
own length, one per 512 tokens up to the device's most; what a graph fixes is its grid's count of
parts, so a step replays the graph for the smallest length bucket (512, 1K, 2K, ... tokens) that
holds its longest context: a short context does not wait on the many parts a long one needs.
Length buckets with the same count share one graph.
A verify step (a sequence's last token and its draft, speculative decoding) replays the same graphs: each of its
rows is a decode of its own over the sequence's block table, attending up to its own position, so a graph's bucket
counts rows, and with speculation on the buckets go up to `max_num_seqs` × (1 + k) rows (at most MAX_ROWS).
`--enforce-eager` turns graphs off, as in vLLM.
"""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from kvtier.kv.pool import KVPool
from kvtier.models.attention import AttentionMetadata, DecodeGroup
from kvtier.models.decoder import Decoder

log = logging.getLogger("kvtier.engine")

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
MAX_ROWS = 512      # the largest bucket verify steps widen the buckets to


class DecodeGraphs:
    """run(token_ids, positions, slots, tables, lens, rows) → logits [rows, vocab] of one decode or verify step.

    rows_per_seq: the most rows a sequence steps with (1 + k with speculation). feature_layers: layers whose outputs
    a step also hands back (`features`, the last step's [rows, features]: a DFlash drafter's input). capture=False
    runs the same forward over the same buffers without capturing it: how the tests check, on CPU and through
    Triton's interpreter, the inputs a graph replays (num_multiprocessors stands in for a GPU's there)."""

    def __init__(self, model: Decoder, pool: KVPool, max_num_seqs: int, max_model_len: int, capture: bool = True,
                 num_multiprocessors: int | None = None, rows_per_seq: int = 1,
                 feature_layers: tuple[int, ...] = ()):
        self.model, self.caches, self.block_size = model, pool.caches, pool.block_size
        self.pad_slot = pool.pad_slot
        most_rows = max(max_num_seqs, min(max_num_seqs * rows_per_seq, MAX_ROWS))
        self.buckets = sorted({b for b in BUCKETS if b < most_rows} | {most_rows})
        self.most = most = self.buckets[-1]
        # graphs need Triton; the engine does not
        from kvtier.models.triton_attention import PART_TOKENS, max_parts, multiprocessors, parts
        self.width = min(pool.blocks_for(max_model_len), pool.num_blocks)   # the longest block table
        longest = self.width * self.block_size
        self.lengths = [n for n in (PART_TOKENS << i for i in range(32)) if n < longest] + [longest]
        sms = multiprocessors(pool.device) if num_multiprocessors is None else num_multiprocessors
        self.most_parts = max_parts(pool.k_cache.shape[2], sms)
        # length bucket → the kernel's grid of parts per context
        self.splits = {n: parts(n, self.most_parts) for n in self.lengths}
        device = pool.device
        # [token ids | positions | slots | context lengths] of `most` rows each, then block tables [most, width]
        size = 4 * most + most * self.width
        self.staging = torch.zeros(size, dtype=torch.long, pin_memory=device.type == "cuda")
        self.inputs = torch.zeros(size, dtype=torch.long, device=device)
        self.token_ids, self.positions, self.slots, self.lens = self.inputs[:4 * most].view(4, most)
        self.tables = self.inputs[4 * most:].view(most, self.width)
        self.rows = torch.arange(most, device=device)
        self.copied = torch.cuda.Event() if device.type == "cuda" else None   # the last step's inputs landed
        self.capture = capture
        self.feature_layers = feature_layers
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}     # by (batch bucket, split count)
        self.outputs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor | None]] = {}   # (logits, features)
        self.features: torch.Tensor | None = None
        self.steps = 0     # decode steps run from the buffers
        if capture:
            self._capture_all()

    def bucket(self, num_rows: int) -> int | None:
        """The smallest captured batch size that holds num_rows, or None when none does."""
        return next((b for b in self.buckets if b >= num_rows), None)

    def split_count(self, longest: int) -> int:
        """The grid's parts per context of the graphs for contexts of at most `longest` tokens."""
        return self.splits[next(n for n in self.lengths if n >= longest)]

    @torch.inference_mode()
    def run(self, token_ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]],
            lens: list[int], rows: list[int]) -> torch.Tensor:
        """Per row its token, position and K/V slot; per sequence its block table, context length after the step
        and count of rows (a verify step's rows each attend as a decode up to their own position)."""
        tables = [table for table, count in zip(map(np.asarray, tables), rows) for _ in range(count)]
        lens = [length - count + 1 + j for length, count in zip(lens, rows) for j in range(count)]
        n = len(token_ids)
        b = self.bucket(n)
        key = (b, self.split_count(max(lens)))
        if self.copied is not None:
            self.copied.synchronize()    # the pinned buffer is free again (the step's sampling waited for it anyway)
        staged = self.staging.numpy()        # numpy writes Python lists in place several times faster than torch
        header = staged[:4 * self.most].reshape(4, self.most)
        for row, values, fill in zip(header, (token_ids, positions, slots, lens), (0, 0, self.pad_slot, 1)):
            row[:n], row[n:b] = values, fill
        staged_tables = staged[4 * self.most:].reshape(self.most, self.width)
        for row, table in zip(staged_tables, tables):
            row[:len(table)] = table              # columns past its length are never read
        staged_tables[n:b, 0] = self.pad_slot // self.block_size
        used = 4 * self.most + b * self.width
        self.inputs[:used].copy_(self.staging[:used], non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        self.steps += 1
        if self.capture:
            self.graphs[key].replay()
        logits, features = self.outputs[key] if self.capture else self._forward(*key)
        # the graphs copy their outputs into one buffer: the next replay overwrites it
        self.features = None if features is None else features[:n].clone()
        return logits[:n].clone()

    def _forward(self, b: int, splits: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One decode step of the first b rows of the buffers, each context in `splits` parts: logits [b, vocab], and
        the feature layers' outputs side by side [b, features] where there are any."""
        decode = DecodeGroup(list(range(b)), [], (self.rows[:b], self.tables[:b], self.lens[:b]), num_splits=splits,
                             most_parts=self.most_parts)
        meta = AttentionMetadata(positions=self.positions[:b], slot_mapping=self.slots[:b], prefills=[],
                                 decode=decode, block_size=self.block_size, generated_rows=list(range(b)))
        meta.feature_layers = self.feature_layers
        return self.model.logits(self.model(self.token_ids[:b], self.caches, meta)), meta.stacked_features()

    @torch.inference_mode()
    def _capture_all(self) -> None:
        """Capture every (bucket, split count), largest first, in one memory pool: the smaller graphs reuse the
        largest's memory."""
        start = time.perf_counter()
        self.slots.fill_(self.pad_slot)      # every row a padding row while capturing
        self.lens.fill_(1)
        self.tables[:, 0] = self.pad_slot // self.block_size
        memory = torch.cuda.graph_pool_handle()
        # one (logits, features) buffer, the largest bucket's, that every graph copies its step's into: outputs kept
        # per graph would hold ~1 GB of a 128K-vocabulary model's logits in verify buckets, outside the pool's budget
        kept = None
        for key in sorted({(b, s) for b in self.buckets for s in self.splits.values()}, reverse=True):
            warm = self._forward(*key)       # warm-up: Triton compiles its kernels, cuBLAS picks its algorithms
            if kept is None:
                kept = tuple(None if t is None else torch.empty_like(t) for t in warm)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            b = key[0]
            # thread-local: a tier mover's CUDA calls meanwhile (its own streams) do not invalidate the capture
            with torch.cuda.graph(graph, pool=memory, capture_error_mode="thread_local"):
                for out, t in zip(kept, self._forward(*key)):
                    if t is not None:
                        out[:b].copy_(t)
            self.outputs[key] = tuple(None if out is None else out[:b] for out in kept)
            self.graphs[key] = graph
        torch.cuda.synchronize()
        log.info("%d decode graphs captured for batch sizes %s (split per context length) in %.1f s",
                 len(self.graphs), ",".join(map(str, self.buckets)), time.perf_counter() - start)
