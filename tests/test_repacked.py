"""Q4_0 weights in ggml's interleaved layout: their only copy, giving back the file's rows for prompt products, and
multiplying each row as it would alone."""
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


@pytest.mark.parametrize("qtype, out_features", [(Q.Q4_1, 48), (Q.Q8_0, 48), (Q.Q4_K, 48), (Q.Q4_0, 44)],
                         ids=["q4_1", "q8_0", "q4_k-rounds-by-its-batch", "q4_0-rows-not-whole-groups"])
def test_other_weights_keep_the_files_layout(qtype, out_features):
    plain = weight(qtype, out_features)
    assert repacked(plain) is plain


def test_ggml_says_nothing_on_stderr_as_it_repacks(capfd):
    """ggml writes a debug line per weight it repacks (224 for a 7B model); kvtier's log takes only its warnings."""
    assert isinstance(repacked(weight(Q.Q4_0, 64)), RepackedWeight)
    assert "repack" not in capfd.readouterr().err
