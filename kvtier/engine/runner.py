"""Turns a scheduled batch into one model forward: flat token batch + attention metadata."""
from __future__ import annotations

import torch

from kvtier.engine.scheduler import ScheduledBatch
from kvtier.kv.pool import KVPool
from kvtier.models.attention import AttentionMetadata, DecodeGroup, PrefillSeq
from kvtier.models.decoder import Decoder


class ModelRunner:
    def __init__(self, model: Decoder, pool: KVPool, device: torch.device):
        self.model = model
        self.pool = pool
        self.device = device

    def _slots(self, block_table: list[int], start: int, end: int) -> torch.Tensor:
        """Pool slots of positions start..end-1 of a sequence."""
        bs = self.pool.block_size
        blocks = torch.tensor(block_table[start // bs: -(-end // bs)], dtype=torch.long)
        slots = (blocks[:, None] * bs + torch.arange(bs)).flatten()
        offset = start // bs * bs
        return slots[start - offset: end - offset]

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, AttentionMetadata, list[int]]:
        """Flat token ids, metadata, and the row of the last token of each sequence."""
        token_ids, positions, slot_mapping, prefills, last_rows = [], [], [], [], []
        decode_rows, decode_tables, decode_lens = [], [], []
        row = 0
        for seq, n in zip(batch.seqs, batch.num_tokens):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            token_ids += seq.token_ids[start:end]
            positions += range(start, end)
            slot_mapping.append(self._slots(seq.block_table, start, end))
            if n == 1 and start > 0:
                decode_rows.append(row)
                decode_tables.append(seq.block_table)
                decode_lens.append(end)
            else:
                prefix = self._slots(seq.block_table, 0, start).to(self.device) if start > 0 else None
                prefills.append(PrefillSeq(row, n, prefix))
            row += n
            last_rows.append(row - 1)
        meta = AttentionMetadata(
            positions=torch.tensor(positions, dtype=torch.long, device=self.device),
            slot_mapping=torch.cat(slot_mapping).to(self.device),
            prefills=prefills,
            decode=self._decode_group(decode_rows, decode_tables, decode_lens),
        )
        return torch.tensor(token_ids, dtype=torch.long, device=self.device), meta, last_rows

    def _decode_group(self, rows, tables, lens) -> DecodeGroup | None:
        if not rows:
            return None
        bs = self.pool.block_size
        max_blocks = max(len(t) for t in tables)
        padded = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.long)
        slots = (padded[:, :, None] * bs + torch.arange(bs)).flatten(1)     # [B, max_blocks * bs]
        max_len = max(lens)
        slots = slots[:, :max_len]
        mask = torch.arange(max_len)[None, :] < torch.tensor(lens)[:, None]
        return DecodeGroup(query_rows=torch.tensor(rows, dtype=torch.long, device=self.device),
                           kv_slots=slots.to(self.device),
                           mask=mask[:, None, None, :].to(self.device))

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> torch.Tensor:
        """Forward the batch; logits [num_seqs, vocab] at each sequence's last scheduled token."""
        token_ids, meta, last_rows = self.prepare(batch)
        hidden = self.model(token_ids, self.pool.kv_cache, meta)
        return self.model.logits(hidden[last_rows])
