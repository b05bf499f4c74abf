"""The benchmarks run end to end on tiny models; the throughput one rewrites only its own section."""
from __future__ import annotations

import os

import pytest
import torch

from kvtier.bench import llama_cpp, throughput
from kvtier.spec.speculator import Speculator


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
    for row in ("prefill@16", "prefill@48", "decode b=1", "decode b=2"):
        assert f"| {row} " in text
    assert "batch-2 decode throughput ≥ 4× transformers' batch-1" in text
    assert "--decode-batch 1,2" in text
    assert throughput.SECTION in capsys.readouterr().out


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_throughput_bench_on_a_built_shape_reports_the_floor(tmp_path, device):
    """A random-weight model of a real shape's layout (128K vocabulary, llama3 RoPE), built offline; decode beside
    the floor, and on CUDA beside transformers compiled."""
    out = tmp_path / "BENCHMARKS.md"
    argv = ["--shape", "tiny-llama3", "--shapes-dir", str(tmp_path / "shapes"), "--device", device,
            "--prefill-lengths", "32", "--decode-tokens", "4", "--decode-batch", "1,2", "--decode-context", "8",
            "--repeats", "1", "--output", str(out)] + (["--hf-compile"] if device == "cuda" else [])
    throughput.main(argv)
    text = out.read_text()
    assert "model tiny-llama3-" in text and "| kvtier / floor |" in text
    rows = [line for line in text.splitlines() if line.startswith("| 1 |") or line.startswith("| 2 |")]
    assert len(rows) == 2 and all(float(row.split("|")[3]) > 0 for row in rows)     # a floor in tok/s
    assert (tmp_path / "shapes" / f"tiny-llama3-{'bfloat16' if device == 'cuda' else 'float32'}" / "config.json").exists()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_itl_bench_runs_on_a_built_shape(tmp_path, device):
    """Streams beside a long prompt on a shape whose context (128K) is far beyond the pool the bench sizes."""
    from kvtier.bench import itl
    out = tmp_path / "BENCHMARKS.md"
    itl.main(["--shape", "tiny-llama3", "--shapes-dir", str(tmp_path / "shapes"), "--device", device,
              "--streams", "2", "--stream-prompt", "16", "--long-prompt", "300", "--alone-tokens", "4",
              "--output", str(out)])
    text = out.read_text()
    assert "| paced (--max-itl-ratio 2) |" in text and "| unpaced (--max-itl-ratio 0) |" in text
    assert "model tiny-llama3-" in text


def test_stall_bench_stalls_every_kind_of_disk_call(tiny_model_dir, tmp_path):
    """The stalled run stalls the disk tier's reads, writes and unlinks, and still answers both prompts."""
    from kvtier.bench import stall
    out = tmp_path / "BENCHMARKS.md"
    stall.main(["--model", tiny_model_dir, "--prompt", "128", "--stall", "0.3", "--seconds", "1.5",
                "--output", str(out)])
    text = out.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| as it is |") or line.startswith("| stalled |")]
    assert len(rows) == 2
    stalled = text.split("in the stalled run: ")[1].split(")")[0]
    assert all(int(stalled.split(f" {kind}")[0].split()[-1]) >= 1 for kind in ("reads", "writes", "unlinks"))


def test_kernels_bench_compares_ggml_with_torch(tmp_path):
    """Every candidate's row, ggml's types among them (the K-quants only where the width is a multiple of 256)."""
    from kvtier.bench import kernels
    out = tmp_path / "BENCHMARKS.md"
    kernels.main(["--shapes", "256x64,64x32", "--rows", "1", "--output", str(out)])
    text = out.read_text()
    for name in ("torch float32", "torch bfloat16", "ggml q8_0", "ggml q4_1"):
        assert text.count(f"| {name} |") == 2
    assert text.count("| ggml q4_k |") == 1 and "not installed" not in text
    assert text.count("| ik_llama.cpp q8_0 |") == (2 if llama_cpp.available() else 0)
    for dtype in ("float32", "bfloat16"):      # what prompt rows take
        assert text.count(f"| ggml q4_1 dequantized + torch {dtype} |") == 2
    # Q4_0 in ggml's CPU_REPACK layout, where this CPU has one: the same product as over the file's blocks
    from kvtier.models import ggml
    blocks, threads = ggml.quantize(torch.randn(32, 64), 2), torch.get_num_threads()
    plain = ggml.Product(blocks, 2, 64, 32, 9, threads)
    plain.x.normal_()
    try:
        repacked = ggml.Product(blocks, 2, 64, 32, 9, threads, repacked=True)
    except ValueError:
        assert "| ggml q4_0 repacked |" not in text
        return
    repacked.x.copy_(plain.x)
    assert torch.allclose(repacked.run(), plain.run(), rtol=1e-5, atol=1e-5)
    assert text.count("| ggml q4_0 repacked |") == 2


@pytest.mark.skipif(not llama_cpp.available(),
                    reason="the ik-llama-cpp-python wheel (no dependency of kvtier's) is not here")
def test_ik_llama_cpp_products_compute_the_product_and_outlive_their_maker():
    """The kernels bench's ik_llama.cpp rows: each call the product of its weight (to the type's rounding), the
    calls alive after their Products is dropped, and more Products than that ggml's 64 contexts one after another."""
    import gc
    weights = [torch.randn(160, 256) / 16 for _ in range(3)]
    for ggml_type, tolerance in ((8, 0.02), (3, 0.15)):      # Q8_0, Q4_1
        products = llama_cpp.Products(weights, ggml_type, 5, 2)
        x = torch.randn(5, 256)
        products.x.copy_(x)
        calls = products.calls
        del products
        for call, w in zip(calls, weights):
            want = x @ w.T
            assert ((call() - want).abs().max() / want.abs().max()).item() < tolerance
    gc.disable()
    try:
        for _ in range(70):
            llama_cpp.Products(weights[:1], 8, 1, 1).calls[0]()
    finally:
        gc.enable()


def test_spec_bench_compares_every_method_on_the_same_turns(tiny_model_dir, tmp_path, capsys):
    from kvtier.bench import spec
    out = tmp_path / "BENCHMARKS.md"
    spec.main(["--model", tiny_model_dir, "--conversations", "1", "--max-tokens", "8", "--workloads", "chat",
               "--output", str(out)])
    text = out.read_text()
    for method in ("off", "ngram", "draft"):
        assert f"| chat | {method} |" in text
    assert "draft / off (a model drafting for itself: no target): chat" in text and "The draft model is" in text


def test_the_spec_bench_quotes_the_same_modules_of_pythons_own_every_run(bundled_tokenizer):
    from kvtier.bench import spec
    edits = spec.conversations(bundled_tokenizer, "editing", len(spec.EDITED))
    sched = open(os.path.join(spec.STDLIB, "sched.py")).read()
    assert sched[:500] in edits[0][0][0]["content"]
    assert "rename `self._queue` to `self._queue_renamed`" in edits[0][0][0]["content"]
    for (first, _), name in zip(edits, spec.EDITED):      # every module has an attribute to rename, named in it
        assert name in first[0]["content"] and "_renamed`" in first[0]["content"]
    (quoted, _), = spec.conversations(bundled_tokenizer, "quoting", 1)
    assert quoted[2]["content"] == open(os.path.join(spec.STDLIB, "bisect.py")).read()[:3000]
    assert len(spec.EDITED) == len(spec.QUOTED) == len(spec.QUESTIONS)
    assert spec.parse_args(["--conversations", "6"]).conversations == 6
    assert spec.quoted(spec.parse_args(["--workloads", "chat"])) == ""
    assert "the editing workload edits sched.py" in spec.quoted(spec.parse_args(["--conversations", "1"]))
    for refused in ("0", "7"):
        with pytest.raises(SystemExit):
            spec.parse_args(["--conversations", refused])


def test_the_spec_bench_refuses_workloads_and_methods_it_does_not_have(capsys):
    """A misspelt workload would have run plain chat under its name, and methods without off had nothing to be
    measured against."""
    from kvtier.bench import spec
    args = spec.parse_args(["--workloads", "quoting,chat", "--methods", "off,ngram"])
    assert (args.workloads, args.methods) == (["quoting", "chat"], ["off", "ngram"])
    for refused, named in ((["--workloads", "edit"], "edit"), (["--workloads", ""], "none given"),
                           (["--methods", "ngram"], "off first"), (["--methods", "off,dflash"], "off first"),
                           (["--methods", "off"], "one or more"), (["--methods", "off,ngram,ngram"], "one or more")):
        with pytest.raises(SystemExit):
            spec.parse_args(refused)
        assert named in capsys.readouterr().err


def test_the_spec_bench_rates_each_turn_over_every_conversation():
    from kvtier.bench.spec import turn_rates
    assert turn_rates({"turns": {1: [30, 1.0], 0: [10, 2.0]}}) == [5.0, 30.0]


def test_the_spec_bench_says_what_the_row_costs_allow():
    from kvtier.bench.spec import ceiling
    speculator = Speculator("ngram", 8)
    assert ceiling(speculator) is None
    speculator.draft_costs = {2: 0.5, 8: 5.0}      # 3 tokens for 1.5 steps beats 9 for 6
    assert ceiling(speculator) == pytest.approx(2.0)


@pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                    reason="on CPU Triton's interpreter runs the CUDA kernels")
def test_the_cuda_kernel_candidates_multiply_as_the_dense_product():
    """The candidates of `kvtier bench kernels --device cuda`: each computes the product its row claims. On CUDA in
    bfloat16, as served (tinygemm and the split-K product over its layout among them); on CPU in float32 through
    Triton's interpreter (tinygemm, which needs CUDA, left out)."""
    from kvtier.bench import kernels
    cuda = torch.cuda.is_available()
    device, dtype = torch.device("cuda" if cuda else "cpu"), torch.bfloat16 if cuda else torch.float32
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(64, 256, generator=gen) for _ in range(2)]
    x = torch.randn(2, 256, generator=gen)
    found = kernels.cuda_candidates(weights, device, dtype)
    expected = {kernels.DENSE, "kvtier Triton Q4_0", "kvtier Triton Q4_K", "kvtier Triton Q6_K",
                "dequantize Q4_0 + dense"}
    if cuda:
        expected |= {"kvtier tinygemm Q4_0", "split-K Triton Q4_0 (tinygemm's layout)"}
    assert set(found) >= expected
    want = x @ weights[0].T
    # what rounding random weights to each type costs: 2 and 3 bits far more than 4 or 5
    loose = {"Q2_K": 0.5, "Q3_K": 0.3, "Q4": 0.2, "Q5_0": 0.2, "Q5_1": 0.2}
    for name, (products, nbytes) in found.items():
        error = (products[0](x.to(device, dtype)).float().cpu() - want).abs().max() / want.abs().max()
        assert error < next((bound for kind, bound in loose.items() if kind in name), 0.05), (name, error)
        assert 0 < nbytes <= weights[0].numel() * 4


def test_every_benchmark_runs_from_the_cli():
    """`kvtier bench NAME` reaches every benchmark module with a main (the README names them so)."""
    import pkgutil
    import subprocess
    import sys
    import kvtier.bench
    from kvtier.cli import BENCHMARKS
    runnable = {m.name for m in pkgutil.iter_modules(kvtier.bench.__path__)
                if "\ndef main(" in open(f"{kvtier.bench.__path__[0]}/{m.name}.py").read()}
    assert runnable == set(BENCHMARKS)
    done = subprocess.run([sys.executable, "-m", "kvtier.cli", "bench", "spec", "--help"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "kvtier bench spec" in done.stdout, done.stderr


def test_turns_bench_times_each_kind_of_turn(tmp_path):
    """The bundled GGUF: kvtier beside kvtier float32 (and llama.cpp where its wheel is installed), each turn's cached
    tokens as the prefix cache should hold them."""
    from kvtier.bench import turns
    out = tmp_path / "BENCHMARKS.md"
    turns.main(["--context", "64", "--cold", "32", "--new", "4", "--answer", "80", "--repeats", "1",
                "--output", str(out)])
    text = out.read_text()
    assert "| turn (time to first token, ms) | kvtier | kvtier float32 |" in text
    assert "| 0 / 32 |" in text and "| 64 / 68 |" in text
    # sent again, and a new prompt sent again after an answer that filled the prompt's block and the next
    assert text.count("| 63 / 64 |") == 2
    assert "| a new 64-token prompt sent again after its 80-token answer (a regenerated answer) |" in text
