"""Manifests: what a saved bounded sequence needs beyond its blocks.

A bounded sequence that finishes over its budget leaves a manifest, keyed by its last sealed
block's key (which names the whole prefix): the block keys, which blocks were resident, the
pager's ledger (stamps, scores, the latest queries, where the reselect clock stood), the key
summaries and the pins. A later request whose prompt continues that prefix restores the
resident blocks onto the device and leaves the others in the host or disk tier, to be paged
in when selected.

Manifests are safetensors files (tensors plus string metadata: magic, version, namespace,
keys, pins) in DIR/<key hex>.kvm, written like block files (files.atomic_write: a temp file
of this process, mode 0600, fsync, rename), the newest MAX_FILES kept; and the most recent
ones in memory. A damaged, foreign or mismatched manifest is a miss; only regular files are
read, so a FIFO or a link in the directory never hangs or misleads the store.
"""
from __future__ import annotations

import json
import logging
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from kvtier.kv.tiers.files import TMP_SUFFIX, atomic_write, is_stale_temp, read_regular, regular_files, remove

log = logging.getLogger("kvtier.kv.manifest")

MAGIC, VERSION, SUFFIX = "kvtier-manifest", 1, ".kvm"
MAX_FILES = 1024
MAX_HEADER_BYTES = 16 << 20    # a manifest header (mostly its block keys) is far smaller
MAX_IN_MEMORY = 8       # each holds its key summaries: ~34 MiB for an 8K-token sequence of SmolLM2's shape


class ManifestError(ValueError):
    """A damaged manifest."""


class ForeignManifest(ManifestError):
    """A manifest of another format version, model or residency setting: left alone, never served."""


@dataclass
class Manifest:
    keys: list[bytes]                   # sealed block keys, in order
    resident: list[bool]                # per block: on the device when saved
    stamps: list[int]
    decoded_since_reselect: int
    pins: list[tuple[int, int]]
    tensors: dict[str, torch.Tensor]    # kmin, kmax, kmean [blocks, ...]; scores [blocks]; queries (optional)
    bounded_from: int | None = None     # the first token computed over a partial resident set

    def to_bytes(self, namespace: bytes) -> bytes:
        meta = {"magic": MAGIC, "version": str(VERSION), "namespace": namespace.hex(),
                "keys": json.dumps([k.hex() for k in self.keys]), "resident": json.dumps(self.resident),
                "stamps": json.dumps(self.stamps), "decoded_since_reselect": str(self.decoded_since_reselect),
                "pins": json.dumps(self.pins), "bounded_from": json.dumps(self.bounded_from)}
        return st_save({name: t.contiguous().cpu() for name, t in self.tensors.items()}, metadata=meta)

    @classmethod
    def from_bytes(cls, data: bytes, namespace: bytes) -> Manifest:
        try:
            tensors = st_load(data)
            meta = _metadata(data)
        except Exception as e:     # safetensors and json errors: a damaged file
            raise ManifestError(f"damaged manifest: {e}") from None
        keys = _block_keys(meta, namespace)
        try:
            manifest = cls(keys, json.loads(meta["resident"]), json.loads(meta["stamps"]),
                           int(meta["decoded_since_reselect"]), [tuple(p) for p in json.loads(meta["pins"])], tensors,
                           json.loads(meta["bounded_from"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ManifestError(f"damaged manifest: {e}") from None
        if not len(keys) == len(manifest.resident) == len(manifest.stamps) == len(tensors.get("kmin", ())):
            raise ManifestError("damaged manifest: its parts disagree on the number of blocks")
        return manifest


def _metadata(data: bytes) -> dict:
    """The string metadata of a safetensors buffer: an 8-byte header length, then a JSON header."""
    size = int.from_bytes(data[:8], "little")
    return json.loads(data[8:8 + size]).get("__metadata__", {})


def _block_keys(meta: dict, namespace: bytes) -> list[bytes]:
    """A manifest's block keys, once its metadata shows it is ours (ForeignManifest if it is not)."""
    if meta.get("magic") != MAGIC or meta.get("version") != str(VERSION):
        raise ForeignManifest(f"not a version-{VERSION} kvtier manifest")
    if meta.get("namespace") != namespace.hex():
        raise ForeignManifest("the manifest belongs to another model or residency setting")
    try:
        return [bytes.fromhex(k) for k in json.loads(meta["keys"])]
    except (KeyError, TypeError, ValueError) as e:
        raise ManifestError(f"damaged manifest: {e}") from None


def _read_block_keys(path: str, namespace: bytes) -> list[bytes]:
    """A manifest file's block keys, from its header alone."""
    try:
        head = read_regular(path, MAX_HEADER_BYTES)
        meta = _metadata(head[:8 + int.from_bytes(head[:8], "little")])
    except (OSError, ValueError, AttributeError) as e:
        raise ManifestError(f"damaged manifest header: {e}") from None
    return _block_keys(meta, namespace)


class ManifestStore:
    """Manifests by key, in memory and (with a directory) on disk. Thread-safe."""

    def __init__(self, namespace: bytes, directory: str | None):
        self.namespace, self.directory = namespace, directory
        self._memory: OrderedDict[bytes, Manifest] = OrderedDict()
        self._on_disk: dict[bytes, list[bytes]] = {}    # manifest key → its block keys, from the file headers
        self._unwritten: set[bytes] = set()             # kept, its write still to come: never dropped from memory
        self._lock = threading.Lock()
        if directory is not None:
            try:
                os.makedirs(directory, exist_ok=True)
                entries, _ = regular_files(directory)
            except OSError as e:
                log.warning("manifests stay in memory only: %s", e)
                self.directory, entries = None, []
            for entry in entries:
                if entry.name.endswith(TMP_SUFFIX) and is_stale_temp(entry.path):
                    remove(entry.path)
            names = [e.name for e in entries if e.name.endswith(SUFFIX) and len(e.name) == 32 + len(SUFFIX)]
            damaged = []
            for name in names:
                path = os.path.join(directory, name)
                try:
                    self._on_disk[bytes.fromhex(name[:-len(SUFFIX)])] = _read_block_keys(path, namespace)
                except ForeignManifest:
                    continue                       # another model's or setting's: left alone
                except ManifestError as e:
                    damaged.append(f"{path}: {e}")
                    remove(path)
            if damaged:
                log.warning("removed %d damaged manifest(s), e.g. %s", len(damaged), damaged[0])

    def block_keys(self, key: bytes) -> list[bytes] | None:
        """The block keys of the manifest stored under key, without reading it; None if there is none."""
        with self._lock:
            if key in self._memory:
                return self._memory[key].keys
            return self._on_disk.get(key)

    def keep(self, key: bytes, manifest: Manifest) -> None:
        """Keep it in memory: a next turn finds it from here on. `write` must follow."""
        with self._lock:
            self._memory[key] = manifest
            self._memory.move_to_end(key)
            self._unwritten.add(key)
            written = [k for k in self._memory if k not in self._unwritten]
            for old in written[:max(0, len(self._memory) - MAX_IN_MEMORY)]:
                del self._memory[old]

    def write(self, key: bytes, manifest: Manifest) -> None:
        """Write a kept manifest to disk (off the engine loop, once the blocks it names are saved: a manifest on disk
        never names a block that is not there); one discarded meanwhile is not."""
        with self._lock:
            if key not in self._unwritten:
                return
            self._unwritten.discard(key)
        if self.directory is None:
            return
        path = self._path(key)
        try:
            atomic_write(path, [manifest.to_bytes(self.namespace)])
        except OSError as e:
            log.warning("could not write manifest %s: %s", path, e)
            return
        with self._lock:
            self._on_disk[key] = manifest.keys
        self._trim()

    def get(self, key: bytes) -> Manifest | None:
        """The manifest, or None (with a warning if a file was there but unusable, which is then removed)."""
        with self._lock:
            if key in self._memory:
                return self._memory[key]
            if key not in self._on_disk:
                return None
        path = self._path(key)
        try:
            return Manifest.from_bytes(read_regular(path), self.namespace)
        except (OSError, ManifestError) as e:
            log.warning("manifest %s is a miss: %s", path, e)
            with self._lock:
                self._on_disk.pop(key, None)
            if isinstance(e, ManifestError) and not isinstance(e, ForeignManifest):
                remove(path)
            return None

    def discard(self, key: bytes) -> None:
        """Forget a manifest that did not fit its request (and delete its file)."""
        with self._lock:
            self._memory.pop(key, None)
            self._unwritten.discard(key)
            on_disk = self._on_disk.pop(key, None) is not None
        if on_disk:
            remove(self._path(key))

    def _trim(self) -> None:
        """Keep the newest MAX_FILES manifest files."""
        with self._lock:
            if len(self._on_disk) <= MAX_FILES:
                return
            paths = [self._path(k) for k in self._on_disk]
        paths.sort(key=lambda p: os.path.getmtime(p) if os.path.exists(p) else 0)
        for path in paths[:len(paths) - MAX_FILES]:
            remove(path)
            with self._lock:
                self._on_disk.pop(bytes.fromhex(os.path.basename(path)[:-len(SUFFIX)]), None)

    def _path(self, key: bytes) -> str:
        return os.path.join(self.directory, key.hex() + SUFFIX)

