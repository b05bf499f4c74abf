"""Warm-up before serving: a process's one-time costs (the CPU product choice, the first call of each kernel and
product shape, buffers faulted in, the chat template compiled) paid before the server says it is ready, not by the
first request."""
from __future__ import annotations

import logging
import time

import torch

from kvtier.engine.sampler import sample
from kvtier.engine.sampling_params import SamplingParams
from kvtier.engine.scheduler import ScheduledBatch
from kvtier.engine.sequence import Sequence
from kvtier.kv.state import KVState

log = logging.getLogger("kvtier.engine")

PROMPT_BLOCKS = 2      # a prompt chunk this long, then a chunk after it (as after a cached prefix), then a decode


def warm_up(engine) -> float:
    """Run each shape class of forward once on throwaway blocks: a prompt chunk, a chunk that attends to a prefix
    in the pool, a decode step; sample once; render a chat; fault in the restore buffers. Returns the seconds it
    took."""
    start = time.perf_counter()
    bs = engine.pool.block_size
    first = max(1, min(PROMPT_BLOCKS * bs, engine.config.max_batched_tokens, engine.max_model_len - bs - 1))
    chunks = [first, bs - 1, 1]
    tokens = [i % engine.model_config.vocab_size for i in range(sum(chunks))]
    blocks = engine.pool.allocate(engine.pool.blocks_for(len(tokens)))
    # a sequence whose K/V no one keeps (its blocks are never sealed); its last token stands for a generated one
    seq = Sequence("warm-up", tokens, SamplingParams(max_tokens=1), None, arrival=-1)
    seq.kv, seq.num_prompt_tokens = KVState("warm-up", seq.token_ids, len(tokens), block_table=blocks), len(tokens) - 1
    try:
        with torch.inference_mode():
            for n in chunks:
                batch = ScheduledBatch()
                batch.add(seq, n)
                logits, _ = engine.runner.run(batch)
                seq.num_computed_tokens += n
            sample(logits[0].float(), [SamplingParams(temperature=0.7, top_p=0.9)], [None])
    finally:
        engine.pool.free(blocks)
    engine.tokenizer.apply_chat_template([{"role": "user", "content": "Hello."}])
    engine.kv.fault_in_buffers()
    seconds = time.perf_counter() - start
    log.info("warmed up in %.2f s", seconds)
    return seconds
