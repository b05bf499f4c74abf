"""Q4_0 and Q4_1 weights in ggml's interleaved layout: their only copy, giving back the file's rows for prompt
products, and multiplying each row as it would alone."""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from kvtier.models import ggml
from kvtier.models.quantized import QuantizedWeight
from kvtier.models.repacked import RepackedWeight, repacked

pytest.importorskip("libggml", reason="libggml-python is a dependency of kvtier")


def weight(qtype: Q, out_features: int = 48, in_features: int = 256) -> QuantizedWeight:
    w = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(0))
    return QuantizedWeight(ggml.quantize(w, int(qtype)), int(qtype), in_features)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1], ids=["q4_0", "q4_1"])
def test_a_q4_weight_is_interleaved_and_gives_back_the_files_rows(qtype):
    plain = weight(qtype)
    packed = repacked(plain)
    # Q4_1: 18-byte Q4_0 blocks and a float32 offset each, for the file's 20 bytes
    assert isinstance(packed, RepackedWeight) and packed.nbytes == plain.nbytes * (1 if qtype == Q.Q4_0 else 22 / 20)
    assert (packed.out_features, packed.in_features, packed.type_name) == (48, 256, qtype.name)
    assert torch.equal(packed.plain(torch.arange(6)), plain.blocks)
    assert torch.equal(packed.plain(torch.tensor([1, 4])), plain.blocks.view(6, 8, -1)[[1, 4]].flatten(0, 1))
    ids = torch.tensor([47, 0, 9, 9, 23, 8, 40])      # unordered, repeated, across groups
    assert torch.equal(packed.rows(ids), plain.rows(ids))
    assert torch.equal(packed.dequantized(), plain.dequantized())


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1], ids=["q4_0", "q4_1"])
def test_each_row_of_a_repacked_product_is_as_it_would_be_alone(qtype):
    plain = weight(qtype)
    packed = repacked(plain)
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(1))
    together = packed.product(x)      # ggml's multi-row kernel takes 4 rows at a time, the one-row one the rest
    for i in range(len(x)):
        assert torch.equal(packed.product(x[i:i + 1])[0], together[i]), i
    if qtype == Q.Q4_0:      # the same blocks: only the order of the sums differs
        want = plain.product(x)
        assert (together - want).abs().max() <= 1e-5 * want.abs().max()
    else:       # Q4_1's offsets multiply x's sums unquantized, where ggml's Q4_1 kernel takes them quantized
        exact = x @ plain.dequantized().T
        assert (together - exact).abs().max() <= 0.01 * exact.abs().max()


def test_a_q4_1_weight_whose_min_would_not_come_back_keeps_the_files_layout():
    """A min of -0.0 comes back from its offset m + 8d as +0.0: not the file's block."""
    plain = weight(Q.Q4_1)
    plain.blocks.view(48, -1, 20)[5, 3, 2:4] = torch.tensor([0x00, 0x80], dtype=torch.uint8)     # float16 -0.0
    assert repacked(plain) is plain


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
