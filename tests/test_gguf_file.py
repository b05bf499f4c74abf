"""kvtier's GGUF reader against the gguf package's: the same metadata and tensors; a damaged file is a ValueError."""
from __future__ import annotations

import os
import re
import struct
import time

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFValueType, GGUFWriter

from kvtier.models.gguf_file import GGUFFile
from gguf_files import quantized_bytes


def every_kind_of_gguf(path) -> None:
    """Every metadata value type, arrays of strings, numbers and bools, and plain and quantized tensors."""
    writer = GGUFWriter(str(path), "llama")
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -5)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.25)
    writer.add_bool("t.bool", True)
    writer.add_string("t.string", "héllo, <|im_end|>")
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -2**62)
    writer.add_float64("t.f64", 1e-300)
    writer.add_array("t.strings", ["a", "", "Ġthe", "日本"] * 50)
    writer.add_array("t.ints", list(range(1000)))
    writer.add_key_value("t.floats", [0.5, -1.5], GGUFValueType.ARRAY, sub_type=GGUFValueType.FLOAT32)
    writer.add_key_value("t.bools", [True, False, True], GGUFValueType.ARRAY, sub_type=GGUFValueType.BOOL)
    rng = np.random.default_rng(0)
    writer.add_tensor("norm.weight", rng.standard_normal(64, dtype=np.float32))
    writer.add_tensor("half.weight", rng.standard_normal((3, 32)).astype(np.float16))
    for qtype in (Q.Q8_0, Q.Q4_1, Q.Q4_K):
        weight = rng.standard_normal((4, 256), dtype=np.float32)
        writer.add_tensor(f"{qtype.name}.weight", quantized_bytes(weight, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_reads_what_ggufs_reader_reads(tmp_path):
    path = tmp_path / "m.gguf"
    every_kind_of_gguf(path)
    ours, theirs = GGUFFile(str(path)), GGUFReader(str(path))
    assert ours.fields == {k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    assert ours.fields["t.strings"][3] == "日本" and ours.fields["t.u64"] == 2**63 + 5
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.tensor_type, list(a.shape), a.n_bytes, a.data_offset) == \
            (b.tensor_type, list(b.shape), int(b.n_bytes), int(b.data_offset))
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape and np.array_equal(a.data, b.data)
        assert not a.data.flags.writeable


def test_a_damaged_file_is_a_value_error_wherever_it_ends(tmp_path):
    path = tmp_path / "m.gguf"
    every_kind_of_gguf(path)
    whole = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    for end in list(range(0, 64)) + list(range(64, len(whole) - 1, 97)):
        cut.write_bytes(whole[:end])
        with pytest.raises(ValueError):
            GGUFFile(str(cut))
    version_2_of_another_order = whole[:4] + (2).to_bytes(4, "big") + whole[8:]
    cut.write_bytes(version_2_of_another_order)
    with pytest.raises(ValueError, match="version"):
        GGUFFile(str(cut))


def header(fields: bytes, field_count: int, tensors: bytes = b"", tensor_count: int = 0) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, tensor_count, field_count) + fields + tensors


def string(text: str) -> bytes:
    return struct.pack("<Q", len(text)) + text.encode()


def u32_field(key: str, value: int) -> bytes:
    return string(key) + struct.pack("<II", 4, value)


def tensor_info(name: str, dims: tuple[int, ...]) -> bytes:
    return string(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims) + struct.pack("<IQ", 0, 0)


@pytest.mark.parametrize("damage", ["alignment 0", "alignment 48", "nested arrays", "a key twice", "a tensor twice",
                                    "5 dimensions", "2**40 fields", "2**40 tensors", "2**40 strings"])
def test_a_damaged_header_is_a_value_error_at_once(tmp_path, damage):
    """What a damaged header can say (counts past the file's size included) fails fast, and only as a ValueError."""
    zeros = bytes(1 << 20)
    data = {
        "alignment 0": header(u32_field("general.alignment", 0), 1),
        "alignment 48": header(u32_field("general.alignment", 48), 1),
        "nested arrays": header(string("a") + struct.pack("<IIQ", 9, 9, 1) + struct.pack("<IQ", 4, 0), 1),
        "a key twice": header(u32_field("a", 1) + u32_field("a", 2), 2),
        "a tensor twice": header(b"", 0, tensor_info("w", (32,)) * 2, 2) + zeros,
        "5 dimensions": header(b"", 0, tensor_info("w", (1, 1, 1, 1, 32)), 1) + zeros,
        "2**40 fields": header(zeros, 2**40),
        "2**40 tensors": header(b"", 0, zeros, 2**40),
        "2**40 strings": header(string("a") + struct.pack("<IIQ", 9, 8, 2**40) + zeros, 1),
    }[damage]
    path = tmp_path / "damaged.gguf"
    path.write_bytes(data)
    start = time.monotonic()
    with pytest.raises(ValueError):
        GGUFFile(str(path))
    assert time.monotonic() - start < 1.0


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="counts mapped pages in /proc/self/smaps (Linux)")
def test_released_tensors_leave_none_of_the_files_pages_mapped(tmp_path):
    """Reading a tensor maps its neighbours' pages too (the kernel's fault-around): released in turn, as the loader
    does, no page of the file stays in the process (its own pages only: 1.8 MB of these 6.4 MB stayed here)."""
    path = os.path.realpath(tmp_path / "many.gguf")     # as /proc/self/smaps names it
    writer = GGUFWriter(path, "llama")
    rng = np.random.default_rng(0)
    for i in range(64):
        writer.add_tensor(f"t{i}.weight", rng.standard_normal(25_000, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    gguf = GGUFFile(path)
    for i, t in enumerate(gguf.tensors):
        assert float(np.abs(t.data).sum()) > 0
        if i == 0:
            assert mapped_kib(path) > 0      # what the count below would see
        gguf.release(t)
    assert mapped_kib(path) == 0, f"{mapped_kib(path)} KiB"


def mapped_kib(path: str) -> int:
    """KiB of the file's pages mapped in this process."""
    total, counted = 0, False
    for line in open("/proc/self/smaps"):
        if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):
            counted = line.rstrip("\n").endswith(" " + path)
        elif counted and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total
