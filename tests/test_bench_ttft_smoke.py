"""The multi-turn TTFT benchmark runs end to end on a tiny model, finds every cached prefix,
and rewrites only its own section."""
from __future__ import annotations

import pytest
import torch

from kvtier.bench import ttft
from kvtier.bench.report import write_section
from kvtier.config import Config
from kvtier.engine.engine import LLMEngine


@pytest.fixture
def one_thread():
    """The engines set torch's thread count for the whole process: give it back afterwards."""
    threads = torch.get_num_threads()
    yield 1    # one thread: OpenMP barriers stall badly when a busy 2-core machine preempts a thread
    torch.set_num_threads(threads)


def test_ttft_bench_measures_every_tier(tiny_model_dir, tmp_path, one_thread):
    args = ttft.parse_args(["--model", tiny_model_dir, "--lengths", "256,1900", "--repeats", "2", "--probe-mib", "8",
                            "--threads", str(one_thread), "--disk-dir", str(tmp_path / "kv"), "--no-write"])
    results = ttft.measure(args)
    rows = ttft.summarize(results)

    assert results["copy_gbs"] > 0 and results["copy_label"] == "memcpy" and results["file_read_gbs"] > 0
    assert results["bytes_per_token"] == 2 * 2 * 2 * 16 * 4   # K and V, 2 layers, 2 KV heads, head dim 16, float32
    assert list(rows) == [256, 1900]
    for length, row in rows.items():
        assert abs(row["history"] - length) <= 64
        assert min(row["expected"]) >= length - 128
        assert all(row["hit"].values()), row["cached"]     # each warm run found the history, cold found nothing
        assert set(row["best"]) == set(ttft.MODES)      # back to back too: its turn found the blocks still saving
        assert all(0 < s < 30 for s in row["best"].values())
    assert results["layout"]["blocks"] == max(rows[1900]["expected"]) // 64
    assert results["layout"]["write-through"] > 0 and results["layout"]["write-back"] > 0
    long = rows[1900]["best"]
    assert long["device"] < long["cold"]     # ~60 tokens computed instead of ~1,900

    out = tmp_path / "BENCHMARKS.md"
    out.write_text("# Benchmarks\n\n## Throughput (kvtier vs transformers)\n\nkeep me\n\n"
                   f"{ttft.SECTION}\n\nstale numbers\n")
    write_section(str(out), ttft.render(results, args, "python -m kvtier.bench.ttft"))
    text = out.read_text()
    assert text.startswith("# Benchmarks\n\n## Throughput (kvtier vs transformers)\n\nkeep me\n\n")
    assert "stale numbers" not in text and text.count(ttft.SECTION) == 1
    assert "(**miss**:" not in text and "not evaluated" in text


def test_a_rewritten_section_keeps_its_notes(tmp_path):
    """A benchmark's new run replaces its table, not what was written by hand under the section's notes."""
    out = tmp_path / "BENCHMARKS.md"
    out.write_text("# Benchmarks\n\n## A (one)\n\nold table\n\n### Notes\n\ntried X: slower\n\n## B\n\nkeep me\n")
    write_section(str(out), "## A (one)\n\nnew table\n")
    assert out.read_text() == ("# Benchmarks\n\n## A (one)\n\nnew table\n\n### Notes\n\ntried X: slower\n\n"
                               "## B\n\nkeep me\n")
    write_section(str(out), "## B\n\nnew B\n")      # a section without notes is replaced whole, to the file's end
    assert out.read_text().endswith("tried X: slower\n\n## B\n\nnew B\n")


def test_a_turn_says_which_of_its_steps_computed_and_leaves_the_runner_as_it_was(tiny_model_dir, one_thread):
    eng = LLMEngine(Config(model=tiny_model_dir, device="cpu", block_size=16, kv_pool_tokens=64 * 16, kv_host_gib=0,
                           prefix_cache=False, max_batched_tokens=64, num_threads=one_thread))
    seconds, cached, load, computed, steps = ttft.ttft(eng, "turn", [(7 * i) % 500 + 20 for i in range(180)])
    assert cached == 0 and load == computed == 0 and 0 < seconds < 30
    # three chunks of at most 64 tokens, each computed; not the steps after, while the disk tier's saves land
    assert [forward for _, forward in steps] == [True] * 3
    assert ttft.steps_note(steps).startswith("; 3 steps computing") and ttft.steps_note(steps).endswith("0 not 0.0 ms")
    assert "run" not in vars(eng.runner)      # the class's run again
    eng.shutdown()
