"""Q4_0 and Q4_1 weights in tinygemm's layout (int4pack.py): the same weights, without requantizing (on CPU), and
tinygemm's products over them near the dequantized weights' (CUDA: gpu marker)."""
import pytest
import torch
from conftest import ggml_quantized
from gguf import GGMLQuantizationType as Q

pytest.importorskip("libggml", reason="libggml-python is a dependency of kvtier")
from kvtier.models.int4pack import Int4PackWeight, int4packed, quants_scales_zeros, takes  # noqa: E402
from kvtier.models.packed import pack  # noqa: E402

OUT, IN = 256, 1024


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1], ids=lambda t: t.name)
def test_tinygemms_terms_give_back_the_files_weights(qtype):
    blocks, weights = ggml_quantized(qtype, OUT, IN, seed=int(qtype), off_centre=0.1)
    quants, scale, zero = quants_scales_zeros(pack(blocks, int(qtype), IN, torch.device("cpu"), torch.float32))
    assert quants.dtype == torch.uint8 and int(quants.max()) <= 15
    rebuilt = (quants.view(OUT, -1, 32).float() - 8) * scale[..., None] + zero[..., None]
    assert (rebuilt.reshape(OUT, IN) - weights).abs().max() <= 1e-5 * weights.abs().max()


def test_only_cuda_bfloat16_q4_weights_of_whole_tiles_convert():
    blocks, _ = ggml_quantized(Q.Q4_0, OUT, IN, seed=int(Q.Q4_0), off_centre=0.1)
    on_cpu = pack(blocks, int(Q.Q4_0), IN, torch.device("cpu"), torch.bfloat16)
    assert not takes(on_cpu) and int4packed(on_cpu) is on_cpu


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1], ids=lambda t: t.name)
def test_tinygemms_products_are_the_dequantized_weights_products(qtype):
    blocks, weights = ggml_quantized(qtype, OUT, IN, seed=int(qtype), off_centre=0.1)
    packed = pack(blocks, int(qtype), IN, torch.device("cuda"), torch.bfloat16)
    converted = int4packed(packed)
    assert isinstance(converted, Int4PackWeight) and converted.nbytes <= 1.12 * blocks.numel()
    x = torch.randn(300, IN, generator=torch.Generator().manual_seed(3))
    want = x.double() @ weights.double().T
    for rows in (1, 16, 300):
        got = converted.product(x[:rows].to("cuda", torch.bfloat16)).double().cpu()
        assert got.shape == (rows, OUT) and (got - want[:rows]).abs().max() <= 0.02 * want.abs().max()
