"""The GPU check: the whole test suite on CUDA, then the GPU benchmarks on random-weight models of real shapes
(Llama-3.2-1B, Llama-3.1-8B), into one report file. Whoever next has a GPU at hand runs it first:

    make gpu-check                                   # python3 -m kvtier.bench.gpu_check --report gpu-check.md

Each step runs in its own process under a time limit; `--only` picks the steps whose names hold one of its texts
(a benchmark's name starts with its shape: '8B throughput', '1B speculative decoding', '1B throughput', ...), so that
calls of up to 10 minutes each cover them, in the order the open issues need them:
`--only 'test suite,8B,speculative' --suite-seconds 300` (the suite spread over 8 processes that share the GPU,
4-5 minutes; `--workers 0` runs it a test at a time, which takes longer than one call; about 480 s in all on an H200,
under the device's 600 s a call), then
`--only 'products,1B throughput'` and `--only 'Mistral,TTFT,latency'`. One that fails or runs out of time is reported
and the next one runs. The benchmarks write their sections into the report, as they do into docs/BENCHMARKS.md; every
step's whole output goes to the log beside it (gpu-check.log), and the 8B step's profile of its int4 decode at
batch 1 (torch's profiler: kernels by self time) to profile-8b-int4-decode.txt there. --dry runs the same steps on
CPU at toy sizes (one test file only collected, the benchmarks on a tiny shape), so that CI keeps the check working.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import time

from kvtier.bench.report import cpu_model, write_section

SECTION = "## GPU check"


@dataclasses.dataclass
class Step:
    name: str
    argv: list[str]           # after `python -m`
    timeout_s: int
    env: dict[str, str] = dataclasses.field(default_factory=dict)


# run one test at a time, the suite takes about 12 minutes on an H100 machine (it captures CUDA graphs for each engine,
# on the CPU's time): its files spread over WORKERS pytest-xdist processes instead (each takes whole files, so that
# their fixtures start once), which share the GPU (tests/conftest.py gives each its part of the device's memory) and
# the CPU (THREADS_PER_WORKER torch threads each)
WORKERS = 8
THREADS_PER_WORKER = 2
# a test module whose client library is not on the GPU machine is reported, the rest runs; one line per test as it
# ends (-v), so that a suite cut off at its limit still says which tests failed
PYTEST_ON_CUDA = ["-v", "--tb=short", "--durations=15", "--continue-on-collection-errors"]
SUITE_SECONDS = 540     # the suite's limit unless --suite-seconds says otherwise


def suite_on_cuda(workers: int, seconds: int) -> Step:
    """The whole suite on CUDA, over `workers` processes (0: in this one, a test at a time), cut off after seconds."""
    spread, threads = [], {}
    if workers:
        spread, threads = ["-n", str(workers), "--dist", "loadfile"], {"OMP_NUM_THREADS": str(THREADS_PER_WORKER)}
    return Step(f"test suite on CUDA, {workers or 'no'} workers", ["pytest", *PYTEST_ON_CUDA, *spread, "tests"],
                seconds, {"KVTIER_DEVICE": "cuda", **threads})


def steps(report: str, dry: bool, workers: int = WORKERS, suite_seconds: int = SUITE_SECONDS) -> list[Step]:
    """What the check runs, in order: on CUDA at the sizes that tell, or (dry) on CPU at toy sizes."""
    out = ["--output", report]
    if dry:
        bench = ["--device", "cpu", "--shape", "tiny-llama3"]
        return [Step("test suite (one file collected)", ["pytest", "-q", "--collect-only", "tests/test_pacer.py"], 300),
                Step("throughput, tiny shape", ["kvtier.bench.throughput", *bench, "--prefill-lengths", "128",
                                                "--decode-batch", "1,4", "--decode-tokens", "8", "--repeats", "1",
                                                *out, "--profile", beside(report, "profile-tiny-decode.txt")], 300),
                Step("multi-turn TTFT, tiny shape", ["kvtier.bench.ttft", *bench, "--lengths", "256",
                                                     "--repeats", "1", "--probe-mib", "8", *out], 300),
                Step("inter-token latency, tiny shape", ["kvtier.bench.itl", *bench, "--streams", "2",
                                                         "--long-prompt", "512", *out], 300),
                Step("products for quantized weights, tiny shapes", ["kvtier.bench.kernels", "--shapes", "256x64",
                                                                     "--rows", "1", *out], 300)]
    cuda = ["--device", "cuda"]
    # in the order the open issues need them: the suite, the 8B shape's int4 decode beside bfloat16, speculation
    return [suite_on_cuda(workers, suite_seconds),
            # int4 weights (Q4_0 blocks, kvtier's Triton kernels) beside bfloat16 ones (transformers left out: a third
            # 16 GB load in the step's time)
            Step("8B throughput, Llama-3.1-8B shape", ["kvtier.bench.throughput", *cuda, "--shape", "llama-3.1-8b",
                                                    "--quantize", "int4", "--no-transformers", "--prefill-lengths",
                                                    "2048,8192", "--decode-batch", "1,16", *out, "--profile",
                                                    beside(report, "profile-8b-int4-decode.txt")], 240),
            Step("1B speculative decoding, Llama-3.2-1B shape", ["kvtier.bench.spec", *cuda, "--shape", "llama-3.2-1b",
                                                              "--conversations", "2", *out], 180),
            Step("1B throughput, Llama-3.2-1B shape", ["kvtier.bench.throughput", *cuda, "--shape", "llama-3.2-1b",
                                                       "--quantize", "int4", "--prefill-lengths", "512,2048,8192",
                                                       "--decode-batch", "1,8,64", *out], 240),
            Step("products for quantized weights", ["kvtier.bench.kernels", *cuda, "--shapes",
                                                    "4096x4096,4096x14336,14336x4096", "--rows", "1,16,2048", *out],
                 200),
            # a GGUF file's K-quants (Q4_K, Q6_K) kept as they are, beside the same weights dequantized
            Step("Mistral-7B throughput, Q4_K_M GGUF shape",
                 ["kvtier.bench.throughput", *cuda, "--shape", "mistral-7b-q4_k_m", "--no-transformers",
                  "--prefill-lengths", "2048", "--decode-batch", "1,16", *out], 180),
            Step("1B multi-turn TTFT, Llama-3.2-1B shape", ["kvtier.bench.ttft", *cuda, "--shape", "llama-3.2-1b",
                                                            "--lengths", "1800,4096,16384", *out], 150),
            Step("1B inter-token latency, Llama-3.2-1B shape", ["kvtier.bench.itl", *cuda, "--shape",
                                                                "llama-3.2-1b", "--streams", "8", "--long-prompt",
                                                                "16000", *out], 120)]


def beside(report: str, name: str) -> str:
    """A file in the report's folder (a step's profile, say)."""
    return os.path.join(os.path.dirname(report), name)


def run_step(step: Step, log: str) -> dict:
    """Run one step; its status (passed, failed or timed out), seconds and the tail of its output. Its whole output
    is appended to log."""
    start = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-m", *step.argv], env={**os.environ, **step.env},
                              capture_output=True, text=True, timeout=step.timeout_s)
        status, output = ("passed" if proc.returncode == 0 else f"failed ({proc.returncode})"), proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        status = f"timed out after {step.timeout_s} s"
        output = "".join(part.decode(errors="replace") if isinstance(part, bytes) else part or ""
                         for part in (e.stdout, e.stderr))
    seconds = time.monotonic() - start
    print(f"{step.name}: {status} in {seconds:.0f} s", flush=True)
    with open(log, "a") as f:
        f.write(f"===== {step.name}: {status} in {seconds:.0f} s\n{output}\n")
    return {"step": step, "status": status, "seconds": seconds, "tail": output[-4000:]}


def device_line(dry: bool) -> str:
    import torch
    if dry or not torch.cuda.is_available():
        return f"{cpu_model()} (dry run on CPU), torch {torch.__version__}"
    props = torch.cuda.get_device_properties(0)
    return (f"{props.name} ({props.total_memory / 2**30:.0f} GiB), {cpu_model()}, torch {torch.__version__}, "
            f"CUDA {torch.version.cuda}")


def render(results: list[dict], machine: str, command: str, heading: str) -> str:
    lines = [heading, "", f"Machine: {machine}.", "", f"Command: `{command}`", "",
             "| step | command | status | seconds |", "| --- | --- | --- | ---: |"]
    for r in results:
        lines.append(f"| {r['step'].name} | `python -m {' '.join(r['step'].argv)}` | {r['status']} | "
                     f"{r['seconds']:.0f} |")
    for r in results:
        if r["status"] != "passed":
            lines += ["", f"### {r['step'].name}: the end of its output", "", "```", r["tail"].rstrip(), "```"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvtier bench gpu_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--report", default="gpu-check.md", help="the report file (default: %(default)s)")
    p.add_argument("--dry", action="store_true", help="on CPU at toy sizes: checks that the check works")
    p.add_argument("--workers", type=int, default=WORKERS, help="processes the suite on CUDA spreads over (0: one, "
                                                               "a test at a time; default: %(default)s)")
    p.add_argument("--suite-seconds", type=int, default=SUITE_SECONDS,
                   help="the suite's time limit, so that a call of 10 minutes has room for a benchmark after it "
                        "(default: %(default)s)")
    p.add_argument("--only", default="", help="run only the steps whose names contain one of these texts "
                                               "(comma-separated)")
    args = p.parse_args(argv)
    if not args.dry:
        import torch
        if not torch.cuda.is_available():
            print("no CUDA device: run with --dry on a machine without one", file=sys.stderr)
            return 2
    report = os.path.abspath(args.report)
    log = os.path.splitext(report)[0] + ".log"
    if not args.only:                           # no section or log of an earlier run may pass for this one's
        for path in (report, log):
            if os.path.exists(path):
                os.remove(path)
    heading = SECTION + (f": the steps named '{args.only}'" if args.only else "")     # one section per call
    write_section(report, heading + "\n\nrunning\n")     # first in the file, the benchmarks' sections after it
    wanted = [text.strip() for text in args.only.split(",")]
    chosen = [step for step in steps(report, args.dry, args.workers, args.suite_seconds)
              if any(text in step.name for text in wanted)]
    if not chosen:
        print(f"no step is named like {args.only!r}", file=sys.stderr)
        return 2
    results = [run_step(step, log) for step in chosen]
    command = "python3 -m kvtier.bench.gpu_check" + (" --dry" if args.dry else "") + \
        (f" --only '{args.only}'" if args.only else "")
    write_section(report, render(results, device_line(args.dry), command, heading))
    print(f"wrote {report}")
    return 0 if all(r["status"] == "passed" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
