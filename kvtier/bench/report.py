"""What the benchmarks share: the machine's description, verdicts, and their section of docs/BENCHMARKS.md."""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import sys


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def processors(device: str) -> str:
    """The GPU, where the device is one, and the CPU: what a benchmark's numbers were measured on."""
    import torch
    gpu = f"{torch.cuda.get_device_name(device)}, " if str(device).startswith("cuda") else ""
    return gpu + cpu_model()


def engine_machine(eng) -> str:
    """Where an engine's numbers come from: the GPU and CPU, torch, its threads, device, dtype and model."""
    import torch
    return (f"{processors(eng.config.device)}, {os.cpu_count()} cores, torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads, device {eng.config.device}, {eng.config.dtypes}, "
            f"model {eng.model_name}")


def header(section: str, machine: str, command: str) -> list[str]:
    """A section's opening lines: heading, when and where it was measured, and the command."""
    return [section, "", f"Measured {datetime.date.today().isoformat()} on: {machine}.", "",
            f"Command: `{command}`", ""]


def verdict(ok: bool) -> str:
    return "met" if ok else "**missed**"


NOTES = "### Notes"     # a section's notes, from this line to its end, outlive the runs that rewrite it


def write_section(path: str, section: str) -> None:
    """Replace the section headed by section's first line (or append it), keeping the rest of the document, and the
    old section's NOTES (its hand-written record of earlier runs and what was tried) after the new one."""
    heading = section.splitlines()[0]
    text = open(path).read() if os.path.exists(path) else "# Benchmarks\n"
    lines = text.splitlines(keepends=True)
    start = next((i for i, line in enumerate(lines) if line.rstrip() == heading), None)
    if start is None:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
        notes = next((i for i in range(start + 1, end) if lines[i].rstrip() == NOTES), end)
        if notes < end:
            section = section.rstrip("\n") + "\n\n" + "".join(lines[notes:end]).rstrip("\n") + "\n"
        rest = "".join(lines[end:])
        text = "".join(lines[:start]) + section + ("\n" + rest if rest else "")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def name_list(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def add_output_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output", default="docs/BENCHMARKS.md")
    parser.add_argument("--no-write", action="store_true", help="only print the table")


def publish(section: str, args: argparse.Namespace) -> None:
    """Print a benchmark's section and, unless --no-write, put it in its place in --output."""
    print()
    print(section)
    if not args.no_write:
        write_section(args.output, section)
        print(f"wrote {args.output}")


def add_device_args(p: argparse.ArgumentParser) -> None:
    """--device, --dtype and --kv-cache-dtype, as `kvtier serve` takes them."""
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default: cpu)")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: the server's)")
    add_kv_cache_dtype_arg(p)


def add_kv_cache_dtype_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "float32", "float16"),  # config's, torch-free
                   help="the KV cache's dtype (kvtier serve --kv-cache-dtype; default: auto, --dtype's)")


def device_settings(args: argparse.Namespace) -> dict:
    """The Config settings of --device, --dtype and --kv-cache-dtype."""
    return {"device": args.device, "kv_cache_dtype": args.kv_cache_dtype,
            **({"dtype": args.dtype} if args.dtype else {})}


def parse_command(module: str, argv: list[str] | None, parse) -> tuple[argparse.Namespace, str]:
    """A benchmark's arguments (argv, else the process's), and the command line that reproduces its run."""
    argv = sys.argv[1:] if argv is None else argv
    return parse(argv), shlex.join(["python", "-m", module, *argv])
