"""A decode step of a decoder with quantized weights, run on CPU as one ggml graph.

Run op by op through torch, a decode step of a small model spends as long dispatching ~20 small ops per layer as
multiplying by its weights. Here the whole step (embedding, per layer the norms, projections over the GGUF blocks,
RoPE, the K/V write into kvtier's pool, attention, the MLP; the final norm and the LM head) is one ggml graph run on
ggml's threadpool, as llama.cpp runs it. The graph reads the weights and the pool where torch keeps them, and is
built once per shape (rows per sequence, each sequence's context length rounded up to CONTEXT_STEP, whether each
context is read in place or gathered, how many rows are prompts' last tokens: below, which sequences' logits are
wanted), the last KEPT_GRAPHS kept: a step writes its token ids, positions, K/V slots and attention masks into the
graph's inputs, sets the sizes of each sequence's attention tensors to its context rounded up to KEY_STEP keys
(`ggml.Lengths`: the graph, planned for the longest, computes over the lengths of the step), and points the views of
a context read in place at the slot where it starts (`ggml.Starts`), so that a new sequence, wherever the pool put
its blocks, takes a graph already built (building one took 9-21 ms).

A sequence of one row over a float32 pool scores its keys in one product over the pool's whole K rows (every K/V
head's, side by side) with its queries spread out to match, each query head's values where its K/V head's lie and
zeros elsewhere: the K/V heads' times the multiplications, but longer dot products over contiguous rows, 0.87-0.96x
the step at 1-7K tokens of context (over float16 no faster). A score comes out bitwise as the per-head product gives it
(which verify steps' rows take, below): ggml's float32 dot product keeps four vectors of sums and adds each element
into the sum its place within a step of floats picks, so where a head's offset is whole steps (head_dim a multiple
of the step) each element meets the same sum in the same order, and the zeros add nothing.

The pool keeps V transposed (KVPool's `values_transposed`: each layer's V as [kv_heads, head_dim, slots]), as
llama.cpp keeps it, so that V's weighted sum is a product over contiguous keys (ggml_mul_mat): at 7.7K tokens of
context ggml's out_prod over V's rows took 1.5x as long, its chains of dependent multiply-adds slower than reading V.
A step writes each new token's V into its column, one value at a time (ggml_set_rows over single values).

A sequence feeds one token, or a verify step's several (its last token and a draft), or a short prompt's (the runner's
SHORT_PROMPT_TOKENS: their logits left out, `sampled`). Its rows attend together: one
product of its keys with all its queries, one softmax, one product of V with the weights, each row's keys past its
own position masked, so a verify step reads its context once, not once per row. Each row still scores bitwise as
it would decode alone (tested), which greedy output under speculation and under load depends on: a score is one dot
product whichever rows stand beside it, and over whole steps of keys (KEY_STEP: ggml's SIMD loop over 64 floats on
AVX-512, 32 on AVX2) a masked key adds an exact zero to the softmax's sum and to each output's dot product over the
keys (over a count of keys not a multiple of the step, ggml sums the last keys one at a time, another order). Each
sequence attends on its own. A context in consecutive pool slots (the pool grows a sequence into the blocks after
its own) is read where it lies; the others are gathered (ggml_get_rows: K a slot's row at a time, V a block's
values of one head dimension at a time), so that a context computes the same bits wherever its blocks lie.

A step may also take prompts' last tokens (`precise`: a prompt cached but for its last token, or one whose chunk ran
just before): the row its first token is sampled from, which multiplies by the weights to about float32's precision
(`ggml.precise_product`), as an eager forward multiplies it, so a cached prompt's first token comes from one graph
instead of a forward op by op (a 1024-token prompt sent again: 48 ms against 114-140).

A DFlash drafter reads the outputs of some of the model's layers (`feature_layers`): a step hands them back beside
the logits, as `features` [rows, features] (each layer's output side by side, the last layer's normed), as the CUDA
graphs and the eager decoder do.
"""
from __future__ import annotations

import time
import weakref
from collections import OrderedDict

import numpy as np
import torch
from torch import nn

from kvtier.kv.pool import KVPool
from kvtier.models import ggml
from kvtier.models.decoder import Decoder, rope_inv_freq
from kvtier.models.quantized import Placed, QuantizedEmbedding, QuantizedLinear


CONTEXT_STEP = 256      # context lengths a graph serves, rounded up: one graph holds 256 decode steps
KEY_STEP = 64           # keys a sequence's rows attend over, rounded up: ggml's SIMD step of floats (module doc)
KEPT_GRAPHS = 8         # graphs of the last shapes kept: verify steps of a few lengths take turns with decode steps


class GgmlDecodeSteps:
    """run(token_ids, positions, slots, tables, lens, rows, precise, sampled) → logits [rows, vocab] of one decode
    step's sampled rows (its last `precise` rows prompts' last tokens), and `features` its feature layers' outputs
    over every row (the interface of the CUDA graphs, engine/graphs.py). The logits are the graph's memory, valid
    until the next step (the engine samples from them within the step): a copy of 49K floats took ~0.12 ms a step,
    its fresh memory's page faults, where the whole step takes ~12."""

    def __init__(self, model: Decoder, pool: KVPool, threads: int, feature_layers: tuple[int, ...] = ()):
        cfg = self.config = model.config
        if pool.dtype not in (torch.float32, torch.float16) or not pool.values_transposed:
            raise ValueError("ggml decode steps need a float32 or float16 KV pool that keeps V transposed")
        self.block_size, self.num_slots = pool.block_size, pool.num_slots
        # a float16 pool's products round the queries and the softmax's weights to float16 too (ggml's float16
        # dot products), as llama.cpp's default cache does
        self.cache_type, self.cache_bytes = ggml.TORCH_TYPES[pool.dtype], pool.dtype.itemsize
        self.row = cfg.num_kv_heads * cfg.head_dim            # one slot's K (or V) floats across heads
        # where a slot's V values lie in its layer's transposed V (apart by a row of slots), and a block's
        self.value_offsets = np.arange(self.row) * self.num_slots
        self.block_rows = np.arange(self.row) * (self.num_slots // self.block_size)
        self.weights = ggml.Context(threads, max_tensors=32 * cfg.num_layers + 16)
        # a one-row sequence's queries spread over whole K rows (module doc): where heads start on whole steps, over
        # a float32 pool (over float16 it measured no faster)
        self.spreads_queries = pool.dtype == torch.float32 and cfg.head_dim % self.weights.lib.float_step == 0
        self.embed = self._embedding(model.model.embed_tokens)
        self.layers = [self._layer(layer) for layer in model.model.layers]
        self.norm = self._float(model.model.norm.weight)
        self.lm_head = self._linear(model.lm_head)
        self.shifted = any(part.shifts is not None for parts, _ in [self.lm_head] + [
            layer[name] for layer in self.layers for name in ("qkv", "o", "gate_up", "down")] for part in parts)
        # per layer its K [slots, row] and its V transposed [row, slots] (in ggml's order of sizes, innermost first)
        self.caches = [(self.weights.place(pool.k_cache[i], ne=(self.row, self.num_slots)),
                        self.weights.place(pool.v_cache[i].permute(1, 2, 0), ne=(self.num_slots, self.row)))
                       for i in range(cfg.num_layers)]
        base = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim)
        # ggml divides each base frequency by a factor: every scaling kvtier knows, as one factor per frequency
        self.freq_factors = self._float((base / rope_inv_freq(cfg)).float())
        self.feature_layers = feature_layers
        self.features: torch.Tensor | None = None     # the last step's feature layers' outputs [rows, features]
        # the last step's queries after RoPE [layers, rows, heads, head_dim], for the pager of bounded sequences:
        # its graph's memory, valid until the next step
        self.queries: torch.Tensor | None = None
        self.built: OrderedDict[tuple, _Step] = OrderedDict()     # the graphs of the last shapes, least recent first
        self.steps = 0
        self.build_seconds = 0.0     # spent building graphs, over its life (a graph evicted and built again too)
        self._finalizer = weakref.finalize(self, _close, self.weights, self.__dict__)

    def run(self, token_ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]],
            lens: list[int], rows: list[int], precise: int = 0, sampled: list[bool] | None = None) -> torch.Tensor:
        """token_ids, positions, slots: per row; tables, lens (its context after the step), rows: per sequence.
        precise: how many of the last sequences are a prompt's last token, one row each, which multiplies by the
        weights to about float32's precision (`ggml.precise_product`), as eager forwards multiply it. sampled: per
        sequence whether its rows' logits are wanted (by default all): the LM head multiplies those rows only, and
        the logits hold theirs alone, in order (a prompt's rows before its last token want none)."""
        lens = np.asarray(lens)
        spans = (-(-lens // CONTEXT_STEP) * CONTEXT_STEP).tolist()
        starts = [self._start(table) for table in tables]
        # a context's views are built at the pool's first slot, so no more keys than the pool holds (ggml checks a
        # view against its memory when it builds it); a step reads its context's keys only (`lengths`, below)
        layouts = tuple((start is not None, min(span, self.num_slots // KEY_STEP * KEY_STEP))
                        for start, span in zip(starts, spans))
        sampled = (True,) * len(rows) if sampled is None else tuple(sampled)
        if not any(sampled) or not all(sampled[len(sampled) - precise:]):
            raise ValueError("a decode step's logits need a sampled sequence, and its precise ones (its last) are")
        key = (tuple(rows), layouts, precise, sampled)
        step = self.built.get(key)
        if step is None:
            if len(self.built) == KEPT_GRAPHS:
                self.built.popitem(last=False)[1].close()
            began = time.perf_counter()
            step = self.built[key] = _Step(self, *key)
            self.build_seconds += time.perf_counter() - began
        self.built.move_to_end(key)
        step.starts.set(np.array([start or 0 for start in starts]))
        step.ids.numpy()[:] = token_ids
        step.positions.numpy()[:] = positions
        step.slots.numpy()[:] = slots
        step.value_slots.numpy()[:] = (np.asarray(slots)[:, None] + self.value_offsets).ravel()
        keys = -(-lens // KEY_STEP) * KEY_STEP
        step.lengths.set(keys)
        # row j of a sequence's r sees its context up to its own position
        step.mask_rows([n - (r - 1 - j) for n, r in zip(lens, rows) for j in range(r)])
        if step.gathered:
            self._gather(step, tables, lens)
        step.graph.compute()
        self.steps += 1
        self.queries = step.queries
        if self.feature_layers:      # each row's layers side by side, copied out of the graph's memory
            self.features = torch.cat(list(step.features), -1)
        return step.logits

    def _start(self, table: list[int]) -> int | None:
        """The slot where a context starts if its blocks are consecutive (read in place), else None (gathered)."""
        if KVPool.consecutive(table):
            return table[0] * self.block_size
        return None

    def blocks_for(self, keys: int) -> int:
        """Blocks a gathered context's V takes for `keys` keys."""
        return -(-keys // self.block_size)

    def _gather(self, step: _Step, tables: list[list[int]], lens: np.ndarray) -> None:
        """The gathered contexts' K slots and V block rows into the step's gather inputs, each padded to its keys
        with its first (masked out)."""
        bs = self.block_size
        k_index, v_index = step.k_gather.numpy(), step.v_gather.numpy()
        k_at = v_at = 0
        for i, (in_place, keys) in enumerate(step.layouts):
            if in_place:
                continue
            table, n = np.asarray(tables[i]), lens[i]
            slots = (table[:, None] * bs + np.arange(bs)).ravel()[:n]
            k_index[k_at:k_at + n], k_index[k_at + n:k_at + keys] = slots, slots[0]
            blocks = np.full(self.blocks_for(keys), table[0])
            blocks[:len(table)] = table
            v_index[v_at:v_at + blocks.size * self.row] = (self.block_rows[:, None] + blocks).ravel()
            k_at, v_at = k_at + keys, v_at + blocks.size * self.row

    def _linear(self, module: nn.Module) -> tuple[list[Placed], int | None]:
        """A projection's ggml weights (its parts, stacked along the output) and bias."""
        parts = [p.placed(self.weights) for p in module.parts] if isinstance(module, QuantizedLinear) else \
            [Placed(self._float(module.weight))]
        return parts, None if module.bias is None else self._float(module.bias)

    def _embedding(self, module: nn.Module) -> int:
        if isinstance(module, QuantizedEmbedding):
            return module.weight.placed_blocks(self.weights)
        return self._float(module.weight)

    def _float(self, tensor: torch.Tensor) -> int:
        return self.weights.place(ggml.aligned(tensor.detach()))

    def _layer(self, layer: nn.Module) -> dict:
        attn = layer.self_attn
        found = {"input_norm": self._float(layer.input_layernorm.weight),
                 "post_norm": self._float(layer.post_attention_layernorm.weight),
                 "qkv": self._linear(attn.qkv_proj), "o": self._linear(attn.o_proj),
                 "gate_up": self._linear(layer.mlp.gate_up_proj), "down": self._linear(layer.mlp.down_proj)}
        if attn.qk_norm:
            found |= {"q_norm": self._float(attn.q_norm.weight),
                      "k_norm": self._float(attn.k_norm.weight)}
        return found

    def close(self) -> None:
        self._finalizer()


def _close(weights: ggml.Context, state: dict) -> None:
    """Free the graphs kept and the weights' context (once: close, or when the steps are collected)."""
    for step in state["built"].values():
        step.close()
    state["built"].clear()
    weights.close()


class _Step:
    """The graph of a decode step of sequences of `rows` rows each, each laid out as `layouts` gives (read in place or
    gathered, its most keys), the last `precise` rows a prompt's last token each, the logits of the sequences marked
    in `sampled` (at least one), with its inputs and output in torch tensors."""

    def __init__(self, steps: GgmlDecodeSteps, rows: tuple[int, ...], layouts: tuple[tuple, ...], precise: int,
                 sampled: tuple[bool, ...]):
        cfg, self.steps = steps.config, steps
        batch = sum(rows)
        self.batch, self.rows, self.layouts, self.precise = batch, rows, layouts, precise
        # the rows whose logits are wanted, by their place in the step
        self.sampled_rows = torch.cat([torch.arange(first, first + r, dtype=torch.int32) for first, r, wanted in
                                       zip(np.cumsum((0,) + rows[:-1]).tolist(), rows, sampled) if wanted] or
                                      [torch.zeros(0, dtype=torch.int32)])
        # tensors per layer: ~40, ~14 per sequence's attention, up to ~17 per weight (up to 7) for precise rows,
        # and up to 9 per product of a shifted weight (repacked.ShiftedWeight)
        shifted = 63 * (1 + bool(precise)) * steps.shifted
        size = (cfg.num_layers + 1) * (64 + 14 * batch + 112 * bool(precise) + shifted)
        ctx = self.ctx = ggml.Context(steps.weights.lib.threads, max_tensors=size, max_nodes=size)
        try:
            self._build()
        except BaseException:       # a graph that cannot be built frees its context
            ctx.close()
            raise
        self.steps = None       # built: no reference back, so the steps' finalizer can free this step with them

    def _build(self) -> None:
        cfg, steps, ctx, batch, rows, layouts = self.steps.config, self.steps, self.ctx, self.batch, self.rows, \
            self.layouts
        self.ids = torch.zeros(batch, dtype=torch.int32)
        self.positions = torch.zeros(batch, dtype=torch.int32)
        self.slots = torch.zeros(batch, dtype=torch.int64)
        self.value_slots = torch.zeros(batch * steps.row, dtype=torch.int64)    # each new V value's place
        self.logits = torch.empty(len(self.sampled_rows), cfg.vocab_size)
        self.features = torch.empty(len(steps.feature_layers), batch, cfg.hidden_size)
        self.queries = torch.empty(cfg.num_layers, batch, cfg.num_heads, cfg.head_dim)
        self.inputs = {"pos": ctx.place(self.positions), "slots": ctx.place(self.slots),
                       "value_slots": ctx.place(self.value_slots)}
        # the gathered contexts': K's slots (keys each), V's rows of a block's values (row per block each)
        keys = [keys for in_place, keys in layouts if not in_place]
        self.gathered = bool(keys)
        if self.gathered:
            self.k_gather = torch.zeros(sum(keys), dtype=torch.int32)
            self.v_gather = torch.zeros(sum(map(steps.blocks_for, keys)) * steps.row, dtype=torch.int32)
            self.inputs |= {"k_gather": ctx.place(self.k_gather), "v_gather": ctx.place(self.v_gather)}
        self.lengths = ggml.Lengths(ctx)        # each sequence's keys: its context rounded up, set each step
        self.starts = ggml.Starts(ctx)          # the slot where each context read in place starts, set each step
        # per sequence [rows, keys]: 0 for each row's own keys, -inf past them (to its sequence's rounded-up length)
        self.masks = [torch.empty(r, keys) for r, (_, keys) in zip(rows, layouts)]
        self.inputs["masks"] = [ctx.place(mask) for mask in self.masks]
        if steps.spreads_queries and 1 in rows:     # [heads, row]: 1 where each query head's K/V head lies
            group = cfg.num_heads // cfg.num_kv_heads
            spread = torch.arange(steps.row) // cfg.head_dim == torch.arange(cfg.num_heads)[:, None] // group
            self.inputs["spread"] = ctx.place(spread.float())
        x = ctx.op("get_rows", steps.embed, ctx.place(self.ids))
        last = cfg.num_layers - 1
        for i, weights in enumerate(steps.layers):
            x = self._layer(x, weights, *steps.caches[i], self.queries[i])
            if i in steps.feature_layers and i != last:
                x = self._feature(x, i)
        x = ctx.op("mul", ctx.op("rms_norm", x, cfg.rms_norm_eps), steps.norm)
        if last in steps.feature_layers:      # as transformers hands the last layer's output: normed
            x = self._feature(x, last)
        if len(self.sampled_rows) < batch:     # the LM head over the sampled rows alone
            x = ctx.op("get_rows", x, ctx.place(self.sampled_rows))
        (logits,) = self._project(x, steps.lm_head, [cfg.vocab_size])
        self.graph = ggml.Graph(ctx, [ctx.place(self.logits, tensor=logits)])
        self.lengths.freeze()
        self.starts.freeze()

    def _feature(self, x: int, layer: int) -> int:
        """x, a layer's output, computed into its place among the step's features."""
        return self.ctx.place(self.features[self.steps.feature_layers.index(layer)], tensor=x)

    def _project(self, x: int, linear: tuple[list[Placed], int | None], sizes: list[int]) -> list[int]:
        """x's product with a projection, cut into pieces of `sizes` output rows each (q/k/v, gate/up)."""
        parts, bias = linear
        ctx, batch = self.ctx, ggml.shape(x)[0][1]
        offsets = np.cumsum([0] + sizes[:-1])
        ys = [self._product(w, x) for w in parts]
        if len(ys) != len(sizes):     # one fused part: views of its rows
            (y,) = ys
            nb1 = ggml.shape(y)[1][1]
            ys = [ctx.op("view_2d", y, n, batch, nb1, int(a) * 4) for a, n in zip(offsets, sizes)]
        if bias is None:
            return ys
        return [ctx.op("add", y, ctx.op("view_2d", bias, n, 1, n * 4, int(a) * 4)) for y, a, n in zip(ys, offsets, sizes)]

    def _product(self, weight: Placed, x: int) -> int:
        """weight's product with x [in, batch]: the precise rows' (the last) to about float32's precision, the
        others' as ggml's product over the blocks takes them (the activations in 8 bits, or a 16-bit weight's type)."""
        if not self.precise:
            return weight.product(self.ctx, x)
        (size, rows, *_), (_, stride, *_) = ggml.shape(x)
        ctx, plain = self.ctx, rows - self.precise
        last = weight.product(ctx, ctx.op("view_2d", x, size, self.precise, stride, plain * stride), precise=True)
        if not plain:
            return last
        return ctx.op("concat", weight.product(ctx, ctx.op("view_2d", x, size, plain, stride, 0)), last, 1)

    def _heads(self, x: int, heads: int) -> int:
        """[heads * head_dim, batch] (maybe a view of a fused product) as [head_dim, heads, batch]."""
        d = self.steps.config.head_dim
        return self.ctx.op("view_3d", x, d, heads, self.batch, d * 4, ggml.shape(x)[1][1], 0)

    def _layer(self, x: int, w: dict, k_cache: int, v_cache: int, queries: torch.Tensor) -> int:
        """A layer over x [hidden, batch]; its queries after RoPE are computed into `queries` [batch, heads, dim]."""
        cfg, ctx, steps = self.steps.config, self.ctx, self.steps
        d, heads, kv_heads, b = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, self.batch
        h = ctx.op("mul", ctx.op("rms_norm", x, cfg.rms_norm_eps), w["input_norm"])
        q, k, v = self._project(h, w["qkv"], [heads * d, kv_heads * d, kv_heads * d])
        q, k = self._heads(q, heads), self._heads(k, kv_heads)
        if cfg.qk_norm:
            q = ctx.op("mul", ctx.op("rms_norm", q, cfg.rms_norm_eps), w["q_norm"])
            k = ctx.op("mul", ctx.op("rms_norm", k, cfg.rms_norm_eps), w["k_norm"])
        q, k = (ctx.op("rope_ext", t, self.inputs["pos"], steps.freq_factors, d, ggml.ROPE_NEOX,
                       cfg.max_position_embeddings, cfg.rope_theta, 1.0, 0.0, 1.0, 32.0, 1.0) for t in (q, k))
        q = ctx.place(queries, tensor=q)
        k_all = ctx.op("set_rows", k_cache, ctx.op("reshape_2d", k, steps.row, b), self.inputs["slots"])
        # V's values one at a time into their columns: rows of one value each
        values = ctx.op("reshape_2d", ctx.op("cont", v), 1, steps.row * b)
        v_all = ctx.op("reshape_2d", ctx.op("set_rows", ctx.op("reshape_2d", v_cache, 1, steps.row * steps.num_slots),
                                            values, self.inputs["value_slots"]), steps.num_slots, steps.row)
        (o,) = self._project(self._attention(q, k_all, v_all), w["o"], [cfg.hidden_size])
        x = ctx.op("add", x, o)
        h = ctx.op("mul", ctx.op("rms_norm", x, cfg.rms_norm_eps), w["post_norm"])
        gate, up = self._project(h, w["gate_up"], [cfg.intermediate_size] * 2)
        (down,) = self._project(ctx.op("swiglu_split", gate, up), w["down"], [cfg.hidden_size])
        return ctx.op("add", x, down)

    def mask_rows(self, lengths: list[int]) -> None:
        """Each row's keys (lengths: per row) open in its mask, its sequence's others closed."""
        first = 0
        for mask, r in zip(self.masks, self.rows):
            own = np.asarray(lengths[first:first + r])[:, None]
            mask.numpy()[:] = np.where(np.arange(mask.shape[1]) < own, 0.0, -np.inf)
            first += r

    def _attention(self, q: int, k_all: int, v_all: int) -> int:
        """[heads * head_dim, batch]: each sequence's queries (q: [head_dim, heads, batch]) over its context in the
        pool after this step's write (K [row, slots], transposed V [slots, row]), read in place where it lies in
        consecutive slots, else gathered."""
        cfg, ctx, row, bs = self.steps.config, self.ctx, self.steps.row, self.steps.block_size
        d, heads, kv_heads = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        if self.gathered:      # K's rows [row, keys], V's per block [block_size, row x blocks], side by side
            k_gathered = self._in_cache_type(ctx.op("get_rows", k_all, self.inputs["k_gather"]))
            v_blocks = ctx.op("reshape_2d", v_all, bs, self.steps.num_slots // bs * row)
            v_gathered = self._in_cache_type(ctx.op("get_rows", v_blocks, self.inputs["v_gather"]))
        outs, first, k_at, v_at = [], 0, 0, 0
        es = self.steps.cache_bytes
        for s, (r, (in_place, n)) in enumerate(zip(self.rows, self.layouts)):
            # built for its most keys, computed over its length rounded up (module doc): [d, n, kv_heads] and
            # [n, d, kv_heads], V's rows `stride` apart; in place, built at the pool's first slot and moved to the
            # context's each step (ggml.Starts)
            if in_place:
                k_source, k_offset, v_source, v_offset, stride = k_all, 0, v_all, 0, self.steps.num_slots
            else:
                stride = self.steps.blocks_for(n) * bs
                k_source, k_offset, v_source, v_offset = k_gathered, k_at, v_gathered, v_at
                k_at, v_at = k_at + n, v_at + stride * row
            values = ctx.op("view_3d", v_source, n, d, kv_heads, stride * es, d * stride * es, v_offset * es)
            if in_place:
                self.starts.follow(values, s, es)
            own = ctx.op("view_3d", q, d, heads, r, d * 4, d * heads * 4, first * d * heads * 4)     # [d, heads, r]
            # softmax(K·q), then V's product with the weights: ggml's flash attention computes two exponentials
            # per key one at a time, 1.3x as long at 2-4K tokens of context
            scores = self._scores(own, k_source, k_offset, n, s, in_place)                          # [n, r, heads]
            mask = self.inputs["masks"][s]
            probs = ctx.op("soft_max_ext", scores, mask, d ** -0.5, 0.0)
            for tensor, dim in ((values, 0), (mask, 0), (scores, 0), (probs, 0)):
                self.lengths.follow(tensor, dim, s, strided=tensor in (values, mask))
            out = ctx.op("mul_mat", values, probs)                                                 # [d, r, heads]
            # [d, heads, r]: one row's as it lies, several rows' copied
            outs.append(ctx.op("reshape_3d", out, d, heads, 1) if r == 1 else
                        ctx.op("cont", ctx.op("permute", out, 0, 2, 1, 3)))
            first += r
        while len(outs) > 1:     # side by side in pairs: each output copied log2(batch) times
            outs = [ctx.op("concat", a, b, 2) for a, b in zip(outs[::2], outs[1::2])] + outs[len(outs) // 2 * 2:]
        return ctx.op("reshape_2d", outs[0], heads * d, self.batch)

    def _scores(self, own: int, k_source: int, k_offset: int, keys: int, s: int, in_place: bool) -> int:
        """Sequence s's scores [keys, rows, heads]: its queries (own: [d, heads, rows]) times its keys, which start
        at row k_offset of k_source ([row, slots]: the pool's K, or the gathered rows). One row's queries spread
        over whole K rows (module doc); several rows' per K/V head, each serving its group of query heads (the
        product broadcasts)."""
        cfg, ctx, row, es = self.steps.config, self.ctx, self.steps.row, self.steps.cache_bytes
        d, heads, rows = cfg.head_dim, cfg.num_heads, ggml.shape(own)[0][2]
        spread = rows == 1 and self.steps.spreads_queries
        if spread:
            k = ctx.op("view_2d", k_source, row, keys, row * es, k_offset * row * es)                  # [row, keys]
        else:
            k = ctx.op("view_3d", k_source, d, keys, cfg.num_kv_heads, row * es, d * es, k_offset * row * es)
        if in_place:
            self.starts.follow(k, s, row * es)
        self.lengths.follow(k, 1, s, strided=True)
        if not spread:
            queries = ctx.op("permute", own, 0, 2, 1, 3)                                           # [d, rows, heads]
            if rows > 1:      # contiguous, as one row's is, so the product takes the path a decode's takes
                queries = ctx.op("cont", queries)
            return ctx.op("mul_mat", k, queries)
        tiled = ctx.op("repeat_4d", ctx.op("reshape_2d", own, d, heads), row, heads, 1, 1)                # [row, heads]
        scores = ctx.op("mul_mat", k, ctx.op("mul", tiled, self.inputs["spread"]))                 # [keys, heads]
        self.lengths.follow(scores, 0, s)
        return ctx.op("reshape_3d", scores, keys, 1, heads)

    def _in_cache_type(self, rows: int) -> int:
        """Gathered K/V rows (ggml's get_rows gives float32) back in the pool's type, so that a gathered context
        computes the bits it computes read in place."""
        if self.steps.cache_type == ggml.F32:
            return rows
        return self.ctx.op("cpy", rows, self.ctx.tensor(self.steps.cache_type, *ggml.shape(rows)[0][:2]))

    def close(self) -> None:
        self.graph.close()
        self.ctx.close()
