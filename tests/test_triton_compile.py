"""kvtier's Triton kernels compile for a CUDA GPU (sm_90, bfloat16 as served), on a machine without one: the other
tests run them in Triton's interpreter, which computes with numpy and would not notice a kernel that cannot
compile (tests/triton_compile.py, in a process of its own with the interpreter off)."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="Triton is installed by the test command")
pytest.importorskip("libggml", reason="libggml-python is a dependency of kvtier")


def test_every_triton_kernel_compiles_for_a_gpu(tmp_path):
    # Triton's interpreter off; its cache of compiled kernels the test's own
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_CACHE_DIR": str(tmp_path)}
    script = os.path.join(os.path.dirname(__file__), "triton_compile.py")
    result = subprocess.run([sys.executable, script, "--quick"], env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    last = result.stdout.strip().splitlines()[-1]
    assert last.endswith(" 0 failed") and " 0 distinct" not in last, last
