"""The GPU check (`make gpu-check`) cannot rot: its steps' arguments are what the benchmarks take, and its dry run
on CPU runs every step and writes the one report."""
from __future__ import annotations

import importlib

from kvtier.bench import gpu_check


def test_every_benchmark_step_parses_its_arguments(tmp_path):
    for dry in (False, True):
        for step in gpu_check.steps(str(tmp_path / "report.md"), dry):
            module, *argv = step.argv
            if module == "pytest":
                continue
            args = importlib.import_module(module).parse_args(argv)
            assert args.output == str(tmp_path / "report.md") and args.device == ("cpu" if dry else "cuda")


def test_the_dry_run_writes_one_report_with_every_step(tmp_path):
    report = tmp_path / "gpu-check.md"
    report.write_text("## GPU check\n\nfrom an earlier run\n")
    assert gpu_check.main(["--dry", "--report", str(report)]) == 0
    text = report.read_text()
    assert "from an earlier run" not in text
    for step in gpu_check.steps(str(report), dry=True):
        assert f"| {step.name} |" in text and "| passed |" in text
    for section in ("## GPU check", "## Throughput", "## Multi-turn TTFT", "## Inter-token latency"):
        assert text.count(section) == 1, section
    assert text.index("## GPU check") < text.index("## Throughput")
    profile = (tmp_path / "profile-tiny-decode.txt").read_text()     # the throughput step's, beside the report
    assert "decode b=1" in profile and "Self CPU" in profile


def test_only_runs_the_steps_it_names_into_a_section_of_their_own(tmp_path):
    report = tmp_path / "gpu-check.md"
    report.write_text("## GPU check\n\nfrom the first call\n")
    # the cheapest step (the full dry run above runs every one); a name no step has picks nothing more
    only = "tiny shapes,no step is named so"
    assert gpu_check.main(["--dry", "--report", str(report), "--only", only]) == 0
    text = report.read_text()
    assert "from the first call" in text and f"## GPU check: the steps named '{only}'" in text
    assert "| products for quantized weights, tiny shapes |" in text
    assert "| throughput, tiny shape |" not in text and "| test suite (one file collected) |" not in text
    assert gpu_check.main(["--dry", "--report", str(report), "--only", "no such step"]) == 2


def test_the_suite_on_cuda_runs_every_test_file_spread_over_workers_or_in_one_process():
    spread, serial = gpu_check.suite_on_cuda(8, 540), gpu_check.suite_on_cuda(0, 540)
    assert spread.argv[-1] == serial.argv[-1] == "tests" and spread.env["KVTIER_DEVICE"] == "cuda"
    assert spread.argv[spread.argv.index("-n") + 1] == "8" and "-n" not in serial.argv
