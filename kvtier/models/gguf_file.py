"""A GGUF file's metadata and tensors, read straight from its memory map.

gguf's own GGUFReader builds a numpy view for every element of every metadata array: SmolLM2's vocabulary (49,152
tokens, 48,900 merges) took it 5.6 s on a 2-core machine, at every start of every engine. Here the header is read
with struct, a string array by a loop of slices, a number array as one numpy view: about 0.1 s. The tensors' bytes
stay in the file map until the loader copies them; `release` then drops a tensor's pages from the process's
resident memory (the page cache keeps them), so a load's resident memory peaks at about one copy of the weights,
not two. Little-endian GGUF, versions 2 and 3 (what llama.cpp writes).
A damaged header fails fast: every count is checked against the bytes left before it is read.
"""
from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass

import numpy as np
import xxhash
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
FAULT_SPAN = 4 << 20    # bytes around a faulting page the kernel may map with it: a large folio is at most 2 MiB
STRING, ARRAY = 8, 9                      # GGUF's value types with a length before their contents
MAX_DIMS = 4                              # GGML_MAX_DIMS
# the fewest bytes an entry takes: a tensor's (name length, 1 dimension, type, offset), a field's (key length, type,
# the smallest value), a string's (its length)
TENSOR_INFO_BYTES, FIELD_BYTES, STRING_BYTES = 8 + 4 + 8 + 4 + 8, 8 + 4 + 1, 8
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
NUMBERS = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
           7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
# tensor types stored as plain numbers: their data comes back as that dtype, shaped as the tensor (outermost first)
PLAIN_TENSORS = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
                 GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                 GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                 GGMLQuantizationType.I64: np.int64}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]      # as GGUF lists dimensions: innermost first
    n_bytes: int
    data_offset: int            # from the start of the file
    data: np.ndarray            # read-only, in the file map: plain numbers shaped outermost first, or each row's blocks
                                # as bytes [..., bytes per row] (gguf's reader gives the same arrays)


class GGUFFile:
    """fields: metadata key → value (str, int, float, bool, or a list of them); tensors: in the file's order.
    Raises ValueError for anything that is not a whole GGUF file this reader knows (and only ValueError)."""

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._map = np.frombuffer(self._mmap, dtype=np.uint8)
        self._buf = memoryview(self._map)
        self._pos = 0
        if bytes(self._take(4)) != MAGIC:
            raise ValueError(f"{path} is not a GGUF file")
        version = self._scalar("<I")
        if version not in VERSIONS:
            raise ValueError(f"{path}: GGUF version {version} (big-endian, or unknown) is not supported")
        tensor_count, field_count = self._scalar("<Q"), self._scalar("<Q")
        self._fits(field_count, FIELD_BYTES)
        fields = {}
        for _ in range(field_count):
            key = self._string()
            if key in fields:
                raise ValueError(f"{path}: metadata key {key!r} appears twice")
            fields[key] = self._value(self._scalar("<I"))
        self._metadata_end = self._pos
        self._fits(tensor_count, TENSOR_INFO_BYTES)
        infos = [self._tensor_info() for _ in range(tensor_count)]
        if len({name for name, *_ in infos}) != len(infos):
            raise ValueError(f"{path}: a tensor name appears twice")
        alignment = fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"{path}: general.alignment {alignment!r} is not a power of two")
        start = -(-self._pos // alignment) * alignment
        self.tensors = [self._tensor(*info, start) for info in infos]
        # number arrays stayed numpy views until the whole header proved sound
        self.fields = {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in fields.items()}

    def metadata_digest(self) -> str:
        """A hash of the header up to the tensors: the metadata (vocabulary, chat template, hyperparameters), the
        same for a copy of the file or one whose weights changed."""
        return xxhash.xxh3_128_hexdigest(self._buf[:self._metadata_end])

    def release(self, tensor: GGUFTensor) -> None:
        """Drop the tensor's pages from this process's memory (they fault back in from the file if read again), and
        any within FAULT_SPAN of it: reading it may have mapped its neighbours' too, as the kernel maps a faulting
        page's (64 KiB around it here, 11 MB of the bundled 93 MB file left mapped when only each tensor's own pages
        went; a kernel that maps whole large folios, up to 2 MiB, maps more)."""
        if not hasattr(mmap, "MADV_DONTNEED"):      # not on every platform: the pages then stay until the map goes
            return
        start = max(0, tensor.data_offset - FAULT_SPAN) // mmap.PAGESIZE * mmap.PAGESIZE
        end = min(len(self._mmap), tensor.data_offset + tensor.n_bytes + FAULT_SPAN)
        self._mmap.madvise(mmap.MADV_DONTNEED, start, end - start)

    def _fits(self, count: int, size: int) -> None:
        """count entries of at least `size` bytes each fit in what is left of the file."""
        if count * size > len(self._buf) - self._pos:
            raise ValueError(f"{self.path}: its header counts {count} entries, more than the file holds")

    def _take(self, n: int) -> memoryview:
        if n < 0 or self._pos + n > len(self._buf):
            raise ValueError(f"{self.path} ends inside its header")
        part = self._buf[self._pos:self._pos + n]
        self._pos += n
        return part

    def _scalar(self, fmt: str):
        return struct.unpack(fmt, self._take(struct.calcsize(fmt)))[0]

    def _string(self) -> str:
        return str(self._take(self._scalar("<Q")), "utf-8")

    def _value(self, value_type: int):
        if value_type == STRING:
            return self._string()
        if value_type == ARRAY:
            item_type, count = self._scalar("<I"), self._scalar("<Q")
            if item_type in NUMBERS:
                return np.frombuffer(self._take(count * np.dtype(NUMBERS[item_type]).itemsize), NUMBERS[item_type])
            if item_type != STRING:      # arrays of arrays: llama.cpp writes none and reads none
                raise ValueError(f"{self.path}: an array of GGUF value type {item_type}")
            self._fits(count, STRING_BYTES)
            return [self._string() for _ in range(count)]
        if value_type not in SCALARS:
            raise ValueError(f"{self.path}: unknown GGUF value type {value_type}")
        return self._scalar(SCALARS[value_type])

    def _tensor_info(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string()
        n_dims = self._scalar("<I")
        if not 1 <= n_dims <= MAX_DIMS:
            raise ValueError(f"{self.path}: tensor {name} has {n_dims} dimensions")
        dims = tuple(self._scalar("<Q") for _ in range(n_dims))
        return name, dims, self._scalar("<I"), self._scalar("<Q")

    def _tensor(self, name: str, shape: tuple[int, ...], raw_type: int, offset: int, start: int) -> GGUFTensor:
        tensor_type = GGMLQuantizationType(raw_type)       # ValueError for a type gguf does not know
        block_size, type_size = GGML_QUANT_SIZES[tensor_type]
        if shape[0] % block_size:
            raise ValueError(f"{self.path}: tensor {name} of sizes {shape} does not hold whole blocks")
        n_bytes = math.prod(shape) // block_size * type_size
        begin = start + offset
        if begin + n_bytes > len(self._map):
            raise ValueError(f"{self.path}: tensor {name} runs past the end of the file")
        data = self._map[begin:begin + n_bytes]
        outer = tuple(reversed(shape))
        if tensor_type in PLAIN_TENSORS:
            data = data.view(PLAIN_TENSORS[tensor_type]).reshape(outer)
        else:
            data = data.reshape(*outer[:-1], shape[0] // block_size * type_size)
        return GGUFTensor(name, tensor_type, shape, n_bytes, begin, data)
