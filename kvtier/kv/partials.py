"""The last, partly filled block of finished sequences, found by its parent's key.

A finished sequence's last block holds fewer than block_size computed tokens, so it has no
content key and the next turn would compute those tokens again. It is kept instead: stored
under a key of its own tokens, H(parent, tokens), in the pool and the tiers like any block,
with the tokens remembered here by the key of the block before it. A later prompt continuing
that parent takes a copy of it (copy-on-write: the published block never changes) for as many
leading tokens as it shares with it: a token's K/V depend only on the tokens up to it.

With a directory (beside the disk tier) each entry is also a small JSON file, written by the
saver after the block itself, so a restarted server finds the partial blocks of the disk
tier too. An entry is checked against its own key when read: a damaged file is a miss.
"""
from __future__ import annotations

import json
import logging
import os
from collections import OrderedDict

from kvtier.kv.keys import block_key
from kvtier.kv.tiers.files import TMP_SUFFIX, atomic_write, is_stale_temp, read_regular, regular_files, remove

log = logging.getLogger("kvtier.kv.partials")

MAX_ENTRIES = 4096
SUFFIX = ".kvp"
MAX_FILE_BYTES = 1 << 16


class PartialBlocks:
    def __init__(self, namespace: bytes, directory: str | None = None, max_entries: int = MAX_ENTRIES):
        self.namespace, self.directory, self.max_entries = namespace, directory, max_entries
        self._by_parent: OrderedDict[bytes | None, tuple[list[int], bytes]] = OrderedDict()
        if directory is not None:
            self._load()

    def add(self, parent: bytes | None, tokens: list[int], key: bytes) -> bool:
        """Remember the block under its parent; False where it was already (nothing new to write)."""
        entry = (list(tokens), key)
        new = self._by_parent.get(parent) != entry
        self._by_parent[parent] = entry
        self._by_parent.move_to_end(parent)
        while len(self._by_parent) > self.max_entries:
            self._by_parent.popitem(last=False)
        return new

    def match(self, parent: bytes | None, tokens: list[int]) -> tuple[bytes, int] | None:
        """The key of the partial block after `parent` and how many leading tokens of `tokens` it holds."""
        entry = self._by_parent.get(parent)
        if entry is None:
            return None
        stored, key = entry
        n = 0
        for a, b in zip(stored, tokens):
            if a != b:
                break
            n += 1
        return (key, n) if n else None

    def write(self, parent: bytes | None, tokens: list[int], key: bytes) -> None:
        """Save an entry to the directory (from the saver thread, after its block)."""
        if self.directory is None:
            return
        record = {"namespace": self.namespace.hex(), "parent": parent and parent.hex(), "tokens": tokens,
                  "key": key.hex()}
        try:
            os.makedirs(self.directory, exist_ok=True)
            atomic_write(self._path(parent), [json.dumps(record).encode()])
        except OSError as e:
            log.warning("a partial block's entry was not saved: %s", e)

    def _path(self, parent: bytes | None) -> str:
        name = f"{self.namespace.hex()[:16]}-{parent.hex() if parent else 'root'}{SUFFIX}"
        return os.path.join(self.directory, name)

    def _load(self) -> None:
        """Take up this namespace's entries, newest last; drop damaged ones and those beyond max_entries."""
        try:
            entries, _ = regular_files(self.directory)
        except OSError:
            return
        mine = []
        for entry in entries:
            if entry.name.endswith(TMP_SUFFIX) and is_stale_temp(entry.path):
                remove(entry.path)
            elif entry.name.startswith(self.namespace.hex()[:16]) and entry.name.endswith(SUFFIX):
                mine.append(entry)
        mine.sort(key=lambda e: e.stat(follow_symlinks=False).st_mtime_ns)
        for entry in mine[:-self.max_entries]:
            remove(entry.path)
        for entry in mine[-self.max_entries:]:
            parsed = self._parse(entry.path)
            if parsed is None:
                remove(entry.path)
            else:
                self.add(*parsed)

    def _parse(self, path: str) -> tuple[bytes | None, list[int], bytes] | None:
        try:
            record = json.loads(read_regular(path, MAX_FILE_BYTES))
            parent = bytes.fromhex(record["parent"]) if record["parent"] else None
            tokens, key = [int(t) for t in record["tokens"]], bytes.fromhex(record["key"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
        if record.get("namespace") != self.namespace.hex() or block_key(parent, tokens, self.namespace) != key:
            return None
        return parent, tokens, key
