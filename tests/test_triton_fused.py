"""The fused elementwise kernels (triton_fused.py) against the eager ops they replace on CUDA: RMSNorm, RoPE and
SiLU(gate) * up, in float32 and bfloat16, over widths that are not powers of two and strided inputs. On CPU they run
in Triton's interpreter (TRITON_INTERPRET=1, set by the test command before Triton is imported); on CUDA compiled."""
import os

import pytest
import torch

triton = pytest.importorskip("triton", reason="Triton is installed by the test command")
from conftest import max_logit_diff, run_greedy  # noqa: E402

from kvtier.config import Config  # noqa: E402
from kvtier.engine.engine import LLMEngine  # noqa: E402
from kvtier.models import decoder, triton_fused  # noqa: E402
from kvtier.models.decoder import RMSNorm, apply_rope  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("on CPU the kernels run only in Triton's interpreter (TRITON_INTERPRET=1)", allow_module_level=True)
DTYPES = [torch.float32, torch.bfloat16]
# units of rounding a bfloat16 result may be off by: it is rounded twice (before the weight, before the product), and
# each may fall on the other side of a boundary (a sum or an exponential in another order; Triton's interpreter
# truncates to bfloat16 where the GPU and torch round to nearest)
BFLOAT16_ULPS = 2
# a float32 SiLU compiled for an NVIDIA GPU takes exp as 2^(x·log2 e) (ex2.approx of a rounded product: ~5.5 units
# off at a gate of -11) and divides without IEEE rounding; the interpreter uses numpy's exp and division
FLOAT32_SILU_ULPS = 16 if DEVICE == "cuda" else 4


def ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference in units of the dtype's rounding at each value's magnitude."""
    step = torch.finfo(want.dtype).eps * want.float().abs().clamp_min(torch.finfo(want.dtype).tiny)
    return ((got.float() - want.float()).abs() / step).max().item()


def eager_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The decoder's RMSNorm on CPU, where it runs the eager ops."""
    norm = RMSNorm(x.shape[-1], eps)
    norm.weight.data = weight.clone()
    return norm(x.cpu())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows, cols", [(1, 64), (5, 96), (3, 4096)])
def test_rms_norm_rounds_as_the_eager_norm(dtype, rows, cols):
    gen = torch.Generator().manual_seed(cols)
    x = (3 * torch.randn(rows, cols, generator=gen)).to(dtype)
    weight = (1 + torch.randn(cols, generator=gen) / 4).to(dtype)
    got = triton_fused.rms_norm(x.to(DEVICE), weight.to(DEVICE), 1e-5).cpu()
    want = eager_rms_norm(x, weight, 1e-5)
    assert got.dtype == dtype and got.shape == x.shape
    # float32: the sum's order and rsqrt's; bfloat16: a value on a rounding boundary once in a while
    assert ulps(got, want) <= (8 if dtype == torch.float32 else BFLOAT16_ULPS)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads, dim", [(3, 64), (20, 80), (40, 128)])
def test_rope_rotates_as_apply_rope_on_a_projections_view(dtype, heads, dim):
    """x is a view into a wider projection (as the decoder's qk is); each product rounded, then their sum."""
    gen = torch.Generator().manual_seed(heads)
    t = 7
    projection = torch.randn(t, (heads + 2) * dim, generator=gen).to(dtype)
    x = projection[:, :heads * dim].reshape(t, heads, dim)
    angles = torch.rand(t, 1, dim // 2, generator=gen) * 100
    cos, sin = (torch.cat([f(angles)] * 2, dim=-1).to(dtype) for f in (torch.cos, torch.sin))
    got = triton_fused.rope(*(a.to(DEVICE) for a in (x, cos, sin))).cpu()
    want = apply_rope(x, cos, sin)
    assert got.is_contiguous() and got.shape == want.shape
    # three roundings (two products, their sum) of values up to about 4
    assert torch.allclose(got.float(), want.float(), rtol=0, atol=3 * 4 * torch.finfo(dtype).eps)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("width", [48, 2 * 1000, 2 * 14336])
def test_silu_mul_is_the_mlps_product(dtype, width):
    gen = torch.Generator().manual_seed(width)
    gate_up = (4 * torch.randn(3, width, generator=gen)).to(dtype)
    got = triton_fused.silu_mul(gate_up.to(DEVICE)).cpu()
    gate, up = gate_up.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    assert got.shape == want.shape
    assert ulps(got, want) <= (FLOAT32_SILU_ULPS if dtype == torch.float32 else BFLOAT16_ULPS)


def test_no_rows_launch_nothing():
    x = torch.empty(0, 64, device=DEVICE)
    assert triton_fused.rms_norm(x, torch.ones(64, device=DEVICE), 1e-5).shape == (0, 64)
    assert triton_fused.silu_mul(torch.empty(0, 32, device=DEVICE)).shape == (0, 16)
    assert triton_fused.rope(torch.empty(0, 2, 64, device=DEVICE), torch.empty(0, 1, 64, device=DEVICE),
                             torch.empty(0, 1, 64, device=DEVICE)).shape == (0, 2, 64)


@pytest.mark.parametrize("model", ["tiny_model_dir", "tiny_qwen3_dir"])
def test_a_decoder_scores_with_the_fused_kernels_as_with_the_eager_ops(request, monkeypatch, model):
    """Their wiring in the decoder (RMSNorm on the hidden state and on Qwen3's per-head queries and keys, RoPE on the
    qkv projection's view, the MLP's halves), through an engine: on CUDA with and without them, on CPU with them put
    where CUDA has them (in the interpreter) and without."""
    engine = LLMEngine(Config(model=request.getfixturevalue(model), device=DEVICE, block_size=16,
                              kv_pool_tokens=32 * 16, kv_host_gib=0, prefix_cache=False, enforce_eager=True))
    prompt = [(7 * i + 3) % 500 + 20 for i in range(40)]
    first = run_greedy(engine, prompt)
    monkeypatch.setattr(decoder, "fused_for", lambda x: None if DEVICE == "cuda" else triton_fused)
    second = run_greedy(engine, prompt)
    fused, eager = (first, second) if DEVICE == "cuda" else (second, first)
    assert fused.tokens == eager.tokens and max_logit_diff(fused, eager) < 1e-4
