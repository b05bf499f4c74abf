"""Q4_0 weights in ggml's interleaved layout, and Q4_1 ones as Q4_0 plus shifts: their only copy, giving back the
file's rows for prompt products, and multiplying each row as it would alone."""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from kvtier.models import ggml
from kvtier.models.quantized import QuantizedWeight
from kvtier.models.repacked import RepackedWeight, ShiftedWeight, repacked

pytest.importorskip("libggml", reason="libggml-python is a dependency of kvtier")


def weight(qtype: Q, out_features: int = 48, in_features: int = 256) -> QuantizedWeight:
    gen = torch.Generator().manual_seed(0)
    # rows off centre, so that Q4_1's minimums matter
    w = torch.randn(out_features, in_features, generator=gen) + torch.randn(out_features, 1, generator=gen)
    return QuantizedWeight(ggml.quantize(w, int(qtype)), int(qtype), in_features)


def test_a_q4_0_weight_is_interleaved_and_gives_back_the_files_rows():
    plain = weight(Q.Q4_0)
    packed = repacked(plain)
    assert isinstance(packed, RepackedWeight) and packed.nbytes == plain.nbytes
    assert (packed.out_features, packed.in_features, packed.type_name) == (48, 256, "Q4_0")
    assert torch.equal(packed.plain(torch.arange(6)), plain.blocks)
    assert torch.equal(packed.plain(torch.tensor([1, 4])), plain.blocks.view(6, 8, -1)[[1, 4]].flatten(0, 1))
    ids = torch.tensor([47, 0, 9, 9, 23, 8, 40])      # unordered, repeated, across groups
    assert torch.equal(packed.rows(ids), plain.rows(ids))
    assert torch.equal(packed.dequantized(), plain.dequantized())


def test_each_row_of_a_repacked_product_is_as_it_would_be_alone():
    plain = weight(Q.Q4_0)
    packed = repacked(plain)
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(1))
    together = packed.product(x)      # ggml's multi-row kernel takes 4 rows at a time, the one-row one the rest
    for i in range(len(x)):
        assert torch.equal(packed.product(x[i:i + 1])[0], together[i]), i
    want = plain.product(x)          # the same blocks: only the order of the sums differs
    assert (together - want).abs().max() <= 1e-5 * want.abs().max()


def test_a_q4_1_weight_is_q4_0_plus_shifts_and_gives_back_the_files_rows():
    plain = weight(Q.Q4_1, 128)
    shifted = repacked(plain)
    assert isinstance(shifted, ShiftedWeight) and isinstance(shifted.base, RepackedWeight)
    assert (shifted.out_features, shifted.in_features, shifted.type_name) == (128, 256, "Q4_1")
    assert shifted.nbytes == pytest.approx(1.1 * plain.nbytes)     # 4.5 bits a weight, and 32 bits per 32
    ids = torch.tensor([127, 0, 9, 9, 64, 8, 40])
    assert torch.equal(shifted.rows(ids), plain.rows(ids))
    assert torch.equal(shifted.dequantized(), plain.dequantized())


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1], ids=lambda t: t.name)
def test_a_repacked_weights_prompt_slices_dequantize_through_ops_planned_once(qtype, monkeypatch):
    """A slice a prompt product dequantizes gets its file blocks back and its op planned at the first product, run
    again after: the file layout's rows, slice after slice; planned again where the memory `plain` reuses moved; a
    slice that is not whole groups of 8 rows goes as `rows`."""
    plain = weight(qtype, 128)
    packed = repacked(plain)
    out = torch.empty(48, 256)
    assert torch.equal(packed.dequantize(32, out), plain.rows(torch.arange(32, 80)))
    planned = dict(packed.slices)
    assert list(planned) == [(32, 48)]
    assert torch.equal(packed.dequantize(80, out), plain.rows(torch.arange(80, 128)))
    assert torch.equal(packed.dequantize(32, out), plain.rows(torch.arange(32, 80)))
    assert packed.slices[32, 48] is planned[32, 48]
    packed.dequantize(80, out)      # the memory `plain` reuses holds other rows' blocks now
    monkeypatch.setattr("kvtier.models.repacked._SCRATCH", {})      # as if another weight had grown it
    assert torch.equal(packed.dequantize(32, out), plain.rows(torch.arange(32, 80)))
    assert packed.slices[32, 48] is not planned[32, 48] and len(packed.slices) == 2
    assert torch.equal(packed.dequantize(3, out[:9]), plain.rows(torch.arange(3, 12)))


@pytest.mark.parametrize("out_features", [128, 72], ids=["one-row-cut-per-thread", "one-row-whole"])
def test_each_row_of_a_shifted_product_is_as_it_would_be_alone_and_as_precise_as_q4_1s(out_features, two_threads):
    """One row's shifts multiply in a part per thread where its outputs divide into whole vectors for each (128 on
    2 threads), several rows' a row per thread: the same sums either way."""
    plain = weight(Q.Q4_1, out_features)
    shifted = repacked(plain)
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(1))
    together = shifted.product(x)
    for i in range(len(x)):
        assert torch.equal(shifted.product(x[i:i + 1])[0], together[i]), i
    want = x.double() @ plain.dequantized().double().T
    error = lambda y: ((y - want).abs().max() / want.abs().max()).item()     # noqa: E731
    # x rounded to 8 bits a block either way; Q4_1's kernel adds its block sums rounded too, the shifts x's own
    assert error(together) <= 1.2 * error(plain.product(x)) < 0.01
    assert error(shifted.precise_product(x)) < 1e-4 < error(plain.precise_product(x))


@pytest.mark.parametrize("qtype, out_features", [(Q.Q8_0, 48), (Q.Q4_K, 48), (Q.Q4_0, 44), (Q.Q4_1, 44)],
                         ids=["q8_0", "q4_k-rounds-by-its-batch", "q4_0-rows-not-whole-groups",
                              "q4_1-rows-not-whole-groups"])
def test_other_weights_keep_the_files_layout(qtype, out_features):
    plain = weight(qtype, out_features)
    assert repacked(plain) is plain


def test_ggml_says_nothing_on_stderr_as_it_repacks(capfd):
    """ggml writes a debug line per weight it repacks (224 for a 7B model); kvtier's log takes only its warnings."""
    assert isinstance(repacked(weight(Q.Q4_0, 64)), RepackedWeight)
    assert "repack" not in capfd.readouterr().err
