"""The needle-in-a-haystack benchmark runs every cell on a tiny model, skips budgets below the minimum,
writes valid heatmap PNGs and rewrites only its own section. The tiny model recalls nothing: no
recall values are asserted."""
from __future__ import annotations

import struct
import zlib

import pytest
import torch

from kvtier.bench import niah
from kvtier.bench.report import write_section
from kvtier.config import KV_POLICIES


@pytest.fixture
def one_thread():
    """The engines set torch's thread count for the whole process: give it back afterwards."""
    threads = torch.get_num_threads()
    yield 1    # one thread: OpenMP barriers stall badly when a busy 2-core machine preempts a thread
    torch.set_num_threads(threads)


def png_pixels(path) -> tuple[int, int, bytes]:
    """Width, height and the inflated image data of an 8-bit RGB PNG, its chunks' CRCs checked."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, []
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        assert struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])[0] == zlib.crc32(kind + body)
        chunks.append((kind, body))
        pos += 12 + length
    assert chunks[0][0] == b"IHDR" and chunks[-1] == (b"IEND", b"")
    width, height, depth, color = struct.unpack(">IIBB", chunks[0][1][:10])
    assert (depth, color) == (8, 2)
    return width, height, zlib.decompress(b"".join(body for kind, body in chunks if kind == b"IDAT"))


def test_niah_bench_runs_every_cell(tiny_model_dir, tmp_path, one_thread):
    out, docs = tmp_path / "BENCHMARKS.md", tmp_path / "docs"
    args = niah.parse_args(["--model", tiny_model_dir, "--lengths", "512", "--depths", "0,1", "--trials", "1",
                            "--budgets", "0.75,0.125", "--chat-length", "400", "--threads", str(one_thread),
                            "--output", str(out), "--docs-dir", str(docs), "--no-write"])
    results = niah.measure(args)

    bounded = {(512, label, policy) for label in ("75%", "12.5%", "512 tokens") for policy in KV_POLICIES}
    assert set(results["cells"]) == {(512, "full", None)} | bounded
    for (_, label, policy), cell in results["cells"].items():
        if label == "12.5%":      # 64 tokens: below sink + tail + one scored block
            assert cell == {"budget": 64, "skipped": "below the 96-token minimum"}
            continue
        assert cell["budget"] == {"full": None, "75%": 384, "512 tokens": 512}[label]
        assert [r["depth"] for r in cell["runs"]] == [0.0, 1.0]
        for run in cell["runs"]:
            assert 512 - 16 < run["prompt_tokens"] <= 512
            assert run["decode_tokens"] == niah.ANSWER_TOKENS - 1 and run["decode_seconds"] > 0
        row = niah.summarize(cell, results["block_bytes"], results["block_size"])
        assert 0 <= row["recall"] <= 1 and row["decode_tps"] > 0
        if cell["budget"] is not None:      # the engine's residency counters reached the report
            assert all(r["traffic"] is not None for r in cell["runs"])
            assert 0 < row["kv_bytes"] <= cell["budget"] // results["block_size"] * results["block_bytes"]
    # a case is the same prompt in every cell
    keys = {tuple(r["prompt_tokens"] for r in c["runs"]) for c in results["cells"].values() if "runs" in c}
    assert len(keys) == 1
    # the saved conversation came back through its manifest: only resident blocks, within the budget
    restore = results["restore"]
    assert restore["moved_blocks"] is not None and 0 < restore["moved_blocks"] <= restore["budget_blocks"] == 32
    assert restore["cached"] == restore["manifest_blocks"] * results["block_size"] > 0
    # the chat probe: the same chats, exact and with every policy at the fixed budget
    chat = results["chat_probe"]
    assert set(chat) == {None, *KV_POLICIES}
    for runs in chat.values():
        assert [r["depth"] for r in runs] == list(niah.CHAT_TURNS)
        assert all(400 < r["prompt_tokens"] < 600 for r in runs), [r["prompt_tokens"] for r in runs]

    paths = niah.write_heatmaps(results, str(docs))
    assert sorted(p.name for p in docs.iterdir()) == sorted(
        ["niah-full.png"] + [f"niah-{p}-{b}.png" for p in KV_POLICIES for b in ("75", "12.5", "512tok")])
    assert len(paths) == 10
    for path in docs.iterdir():
        width, height, pixels = png_pixels(path)
        assert width > 100 and height > 100 and len(pixels) == height * (width * 3 + 1)

    out.write_text("# Benchmarks\n\n## Throughput (kvtier vs transformers)\n\nkeep me\n\n"
                   f"{niah.SECTION}\n\nstale numbers\n\n## Multi-turn TTFT (cold vs warm tiers)\n\nkeep me too\n")
    section = niah.render(results, args, "python -m kvtier.bench.niah")
    write_section(str(out), section)
    text = out.read_text()
    assert text.startswith("# Benchmarks\n\n## Throughput (kvtier vs transformers)\n\nkeep me\n\n")
    assert text.endswith("## Multi-turn TTFT (cold vs warm tiers)\n\nkeep me too\n")
    assert "stale numbers" not in text and text.count(niah.SECTION) == 1
    assert "| 512 | 12.5% (64) | all | n/a (below the 96-token minimum) |" in text
    assert "the chat probe with a 512-token budget recalls the key wherever exact attention does" in text
    assert all(f"(docs/{path.name})" in text for path in docs.iterdir())
    assert text.count("not evaluated") == 4     # one length only: no target can be read
    assert "moves at most its budget of blocks to the device: met" in text
