"""Q4_0 and Q4_1 weights in tinygemm's layout (int4pack.py): the same weights, without requantizing (on CPU); rows
dequantized from the layout (Triton's interpreter on CPU), the layout as aten's conversion writes it, and tinygemm's
products near the dequantized weights' (CUDA: gpu marker)."""
import os

import pytest
import torch
from conftest import ggml_quantized
from gguf import GGMLQuantizationType as Q

pytest.importorskip("libggml", reason="libggml-python is a dependency of kvtier")
from kvtier.models.int4pack import (INNER_K_TILES, TINYGEMM, Int4PackWeight, choose_decode_products,  # noqa: E402
                                    int4packed, quants_scales_zeros, takes)
from kvtier.models.packed import pack  # noqa: E402

OUT, IN = 256, 1024
ON_CUDA_OR_INTERPRETED = pytest.mark.skipif(not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
                                            reason="on CPU the kernel runs only in Triton's interpreter")


def tinygemm_layout(quants: torch.Tensor) -> torch.Tensor:
    """Quants (uint8 [N, K], 0-15) in the int32 words aten's CUDA conversion writes (triton_int4pack.py's docstring):
    word (n_tile, k_outer, t = 4r + c, i), nibble 4 * low + 2 * second + half: weight 2 * (c + 4 * half) + low of
    k-tile 2i + second, row 8 * n_tile + r."""
    n, k = quants.shape
    q = quants.long().view(n // 8, 8, k // (16 * INNER_K_TILES), INNER_K_TILES // 2, 2, 2, 4, 2)
    # (n_tile, r, k_outer, i, second, half, c, low) -> (n_tile, k_outer, r, c, i, low, second, half)
    nibbles = q.permute(0, 2, 1, 6, 3, 7, 4, 5).reshape(n // 8, k // (16 * INNER_K_TILES), 32, INNER_K_TILES // 2, 8)
    words = (nibbles << (4 * torch.arange(8))).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def converted(qtype, device: str) -> tuple[Int4PackWeight, torch.Tensor]:
    """A random weight of qtype in tinygemm's layout on device (the layout written by tinygemm_layout), and the
    weight that layout holds, from its rounded scales and zeros (float32)."""
    blocks, _ = ggml_quantized(qtype, OUT, IN, seed=int(qtype), off_centre=0.1)
    quants, scale, zero = quants_scales_zeros(pack(blocks, int(qtype), IN, torch.device("cpu"), torch.float32))
    scales_and_zeros = torch.stack([scale, zero], -1).to(torch.bfloat16).transpose(0, 1).contiguous()
    weight = Int4PackWeight(int(qtype), IN, OUT, tinygemm_layout(quants).to(device), scales_and_zeros.to(device))
    scale, zero = (scales_and_zeros.float().transpose(0, 1)[..., j].repeat_interleave(32, 1) for j in (0, 1))
    return weight, (quants.float() - 8) * scale + zero


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


@ON_CUDA_OR_INTERPRETED
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1], ids=lambda t: t.name)
def test_rows_dequantized_from_tinygemms_layout_are_its_weights(qtype):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    weight, want = converted(qtype, device)
    ids = torch.tensor([0, 7, 8, 9, 130, 255])
    got, every_row = weight.rows(ids).cpu(), weight.rows(torch.arange(OUT)).cpu()
    # rounded to bfloat16: to nearest on CUDA, towards zero in Triton's interpreter
    assert got.dtype == torch.bfloat16 and torch.equal(got, every_row[ids])
    assert ((every_row.float() - want).abs() <= 2**-7 * want.abs()).all()


@ON_CUDA_OR_INTERPRETED
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1], ids=lambda t: t.name)
def test_the_split_k_product_multiplies_the_layouts_weights(monkeypatch, qtype):
    """triton_int4pack.product, K split into 1, 2 or 8 parts, against the weights the layout holds (float32 rows in
    the interpreter; bfloat16 on CUDA, as served); 16 rows a launch here, so the 19 rows take two."""
    from kvtier.models import triton_int4pack
    from kvtier.models.triton_int4pack import product, splits_for
    monkeypatch.setattr(triton_int4pack, "ROWS_PER_LAUNCH", 16)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    weight, want_weight = converted(qtype, device)
    x = torch.randn(19, IN, generator=torch.Generator().manual_seed(5)).to(dtype)
    want = x.double() @ want_weight.double().T
    tolerance = 0.02 if dtype == torch.bfloat16 else 1e-5
    for splits in (1, 2, 8):
        got = product(weight.packed, weight.scales_and_zeros, 32, x.to(device), splits).double().cpu()
        assert got.shape == (19, OUT) and (got - want).abs().max() <= tolerance * want.abs().max(), splits
    assert splits_for(OUT, IN, programs=4) == 1 and splits_for(OUT, IN, programs=16) == 2
    assert splits_for(OUT, IN, programs=10**6) == IN // 128      # at most one k_outer a split
    assert splits_for(16, 64, programs=8) == 1                    # no whole tile: a count, not an endless loop
    with pytest.raises(ValueError, match="multiple"):
        product(weight.packed, weight.scales_and_zeros, 32, x.to(device), 16)


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1], ids=lambda t: t.name)
def test_the_split_k_product_rounds_a_row_alike_in_any_batch(qtype):
    """A decode row and the same row among a verify step's or a batch's: the same bits, as speculation's greedy
    identity needs of whatever multiplies decode rows."""
    from kvtier.models.triton_int4pack import product
    weight, _ = converted(qtype, "cuda")
    x = torch.randn(70, IN, generator=torch.Generator().manual_seed(6)).to("cuda", torch.bfloat16)   # two launches
    alone = torch.cat([product(weight.packed, weight.scales_and_zeros, 32, x[i:i + 1], 4) for i in range(70)])
    assert torch.equal(product(weight.packed, weight.scales_and_zeros, 32, x, 4), alone)
    assert torch.equal(product(weight.packed, weight.scales_and_zeros, 32, x[3:8], 4), alone[3:8])


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1], ids=lambda t: t.name)
def test_atens_conversion_writes_the_layout_the_rows_are_read_from(qtype):
    blocks, _ = ggml_quantized(qtype, OUT, IN, seed=int(qtype), off_centre=0.1)
    quants, _, _ = quants_scales_zeros(pack(blocks, int(qtype), IN, torch.device("cpu"), torch.float32))
    written = torch.ops.aten._convert_weight_to_int4pack((quants[:, ::2] << 4 | quants[:, 1::2]).cuda(),
                                                         INNER_K_TILES)
    assert torch.equal(written.cpu(), tinygemm_layout(quants))


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


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1], ids=lambda t: t.name)
def test_decode_products_are_chosen_per_shape_among_those_that_agree(qtype):
    """At load each shape's decode rows get tinygemm's product or the split-K one, as its weights measured in CUDA
    graphs: every weight of the shape the same one, which multiplies as tinygemm does."""
    weights = [converted(qtype, "cuda")[0] for _ in range(3)]
    choices = choose_decode_products(weights)
    (chosen, seconds), = choices.values()
    assert set(choices) == {(OUT, IN)} and set(seconds) == {"tinygemm", "split-K Triton"}
    assert all(0 < s < 1 for s in seconds.values())      # each ran, agreed and was timed
    splits = {w.splits for w in weights}
    assert len(splits) == 1 and (splits == {TINYGEMM}) == (chosen == "tinygemm")
    x = torch.randn(100, IN, generator=torch.Generator().manual_seed(4)).to("cuda", torch.bfloat16)
    want = weights[0].product_with(x, TINYGEMM).float()
    assert (weights[0].product(x).float() - want).abs().max() <= 2 ** -6 * want.abs().max()
