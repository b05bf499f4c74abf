"""kvtier: an LLM inference server with a bounded, tiered, content-addressed, persistent KV cache."""
import os

# Large CPU tensors on transparent huge pages: restoring KV from disk reads into fresh buffers, and
# faulting them in 4 KiB at a time halves the read bandwidth (1.6 vs 2.2 GB/s measured here). torch
# reads this once, at its first allocation, so it only takes effect when kvtier is imported first
# (the `kvtier` command and `python -m kvtier...` are).
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
