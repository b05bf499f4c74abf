"""ggml's products over GGUF's own blocks, through the ctypes binding (kvtier/models/ggml.py): each type's product
equals the float32 product with the weight dequantized by the gguf package (so the blocks are laid out as GGUF
files hold them), within what ggml's quantized activations cost; a weight of the wrong size is refused."""
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

pytest.importorskip("libggml", reason="the libggml-python wheel is installed by the test command")
from kvtier.models import ggml  # noqa: E402

TYPES = [GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q4_K,
         GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 5])
def test_a_product_equals_the_dequantized_weights_product(qtype, rows):
    gen = torch.Generator().manual_seed(int(qtype) + rows)
    out_features, in_features = 96, 512
    weight = torch.randn(out_features, in_features, generator=gen)
    blocks = ggml.quantize(weight, int(qtype), threads=2)
    dequantized = torch.from_numpy(dequantize(blocks.numpy(), qtype)).reshape(out_features, in_features)
    product = ggml.Product(blocks, int(qtype), in_features, out_features, rows, threads=2)
    x = torch.randn(rows, in_features, generator=gen)
    product.x.copy_(x)
    got, want = product.run().clone(), x @ dequantized.T
    assert (got - want).abs().max() <= 0.02 * want.abs().max()       # the activations' own quantization only
    assert (want - x @ weight.T).abs().max() <= 0.15 * want.abs().max()   # and the weight is what it was
    product.x.copy_(2 * x)
    assert torch.allclose(product.run(), 2 * got, rtol=0.05, atol=0.05 * want.abs().max().item())   # reused


def test_a_weight_of_the_wrong_size_is_refused():
    blocks = ggml.quantize(torch.randn(8, 64), int(GGMLQuantizationType.Q8_0))
    with pytest.raises(ValueError, match="takes"):
        ggml.Product(blocks[:-1], int(GGMLQuantizationType.Q8_0), 64, 8, 1, threads=1)
