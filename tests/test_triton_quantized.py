"""The Triton kernels over packed GGUF blocks (packed.py, triton_quantized.py) against the gguf package's
dequantization, for every packed type. On CPU they run in Triton's interpreter (TRITON_INTERPRET=1, set by the test
command before Triton is imported); on CUDA compiled."""
import os

import pytest
import torch
from conftest import ggml_quantized
from gguf import GGMLQuantizationType as Q

pytest.importorskip("triton", reason="Triton is installed by the test command")
pytest.importorskip("libggml", reason="libggml-python is a dependency of kvtier")
from kvtier.models import ggml  # noqa: E402
from kvtier.models.packed import PACKED_TYPES, pack, packable, packed_bytes  # noqa: E402
from kvtier.models.triton_quantized import BLOCK_M  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
if DEVICE.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("on CPU the kernels run only in Triton's interpreter (TRITON_INTERPRET=1)", allow_module_level=True)
OUT, IN = 72, 768       # outputs not a multiple of the kernels' tiles; three K-quant super-blocks per row


@pytest.mark.parametrize("qtype", PACKED_TYPES, ids=lambda t: t.name)
def test_each_type_dequantizes_to_the_files_weights_and_multiplies_by_them(qtype):
    blocks, weights = ggml_quantized(qtype, OUT, IN)
    packed = pack(blocks, int(qtype), IN, DEVICE, torch.float32)
    # the file's bytes, sub-block scales a byte each (Q3_K: 114 bytes per 256 weights for 110)
    assert packed.nbytes == packed_bytes(int(qtype), blocks.numel()) <= 1.04 * blocks.numel()
    ids = torch.tensor([5, 0, 71, 5, 33])
    assert torch.equal(packed.rows(ids).cpu(), weights[ids])
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, IN, generator=gen)
    want = x.double() @ weights.double().T
    got = packed.product(x.to(DEVICE)).cpu()
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    # a row's result does not depend on the rows beside it, to the bit (BLOCK_M rows to a program, and more)
    batch = torch.cat([x, torch.randn(BLOCK_M + 5, IN, generator=gen) * 100])
    assert torch.equal(packed.product(batch.to(DEVICE)).cpu()[:3], got)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_precision_products_round_as_the_dequantized_weights_do(dtype):
    if DEVICE.type == "cpu" and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter computes with numpy, which has no bfloat16")
    blocks, weights = ggml_quantized(Q.Q4_K, OUT, IN)
    packed = pack(blocks, int(Q.Q4_K), IN, DEVICE, dtype)
    assert packed.rows(torch.arange(OUT)).dtype == dtype
    x = torch.randn(2, IN, generator=torch.Generator().manual_seed(2))
    want = x.double() @ weights.to(dtype).double().T
    got = packed.product(x.to(DEVICE, dtype)).cpu()
    assert got.dtype == dtype and (got.double() - want).abs().max() <= 0.01 * want.abs().max()


def test_types_without_a_kernel_are_refused():
    blocks = ggml.quantize(torch.randn(4, 256), int(Q.IQ3_S))
    assert not packable(int(Q.IQ3_S))
    with pytest.raises(ValueError, match="IQ3_S"):
        pack(blocks, int(Q.IQ3_S), 256, DEVICE, torch.float32)
