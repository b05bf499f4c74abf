"""The throughput benchmark runs end to end on a tiny model and rewrites only its own section."""
from __future__ import annotations

from kvtier.bench import throughput


def test_throughput_bench_writes_its_section(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "BENCHMARKS.md"
    out.write_text("# Benchmarks\n\n## Throughput (kvtier vs transformers)\n\nold numbers\n\n"
                   "## Multi-turn TTFT\n\nkeep me\n")
    throughput.main(["--model", tiny_model_dir, "--prefill-lengths", "16,48", "--decode-tokens", "4",
                     "--decode-batch", "1,2", "--decode-context", "8", "--repeats", "1",
                     "--output", str(out)])
    text = out.read_text()
    assert "old numbers" not in text
    assert text.count(throughput.SECTION) == 1
    assert text.endswith("## Multi-turn TTFT\n\nkeep me\n")
    for row in ("prefill@16", "prefill@48", "decode b=1", "decode b=2", "decode kvtier b=2 vs transformers b=1"):
        assert f"| {row} " in text
    assert "--decode-batch 1,2" in text
    assert throughput.SECTION in capsys.readouterr().out
