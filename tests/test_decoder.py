"""The decoder's own layers against their plain definitions."""
import itertools
import math
import time

import pytest
import torch
import torch.nn.functional as F

from kvtier.models.products import FEW_ROWS, Linear, many_rows_product, onednn_linear


@pytest.mark.parametrize("bias", [False, True])
def test_linear_gives_f_linear_for_every_row_count(bias):
    """Few rows (decode steps of a few sequences) and more take other products on CPU: the same values,
    contiguous."""
    torch.manual_seed(0)
    layer = Linear(96, 200, bias=bias)
    for rows in range(1, 4 * FEW_ROWS):
        x = torch.randn(rows, 96, dtype=torch.float64).float()
        got = layer(x)
        assert got.is_contiguous() and got.shape == (rows, 200)
        assert torch.allclose(got.double(), F.linear(x.double(), layer.weight.double(),
                                                     None if layer.bias is None else layer.bias.double()), atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prompt_chunks_take_a_product_that_gives_f_linear(dtype, monkeypatch):
    """Many rows take oneDNN's product where it agrees with F.linear, else F.linear: either gives F.linear's values,
    with a bias too and over rows that are not whole blocks, and the choice is made once, the same whatever the machine's load (clocks under which the later
    of two products looks slower, then faster, do not move it): the two round otherwise, and K/V restored after a
    restart must be what a cold prompt computes now."""
    product = many_rows_product(dtype).__wrapped__        # its rows padded to whole blocks (products.ROW_BLOCK)
    assert product in (F.linear, onednn_linear) and many_rows_product(dtype).__wrapped__ is product
    try:
        for clock in (lambda n: n * n, math.sqrt):
            ticks = itertools.count(1)
            monkeypatch.setattr(time, "perf_counter", lambda clock=clock, ticks=ticks: clock(next(ticks)))
            many_rows_product.cache_clear()
            assert many_rows_product(dtype).__wrapped__ is product
    finally:
        many_rows_product.cache_clear()
    torch.manual_seed(1)
    layer = Linear(64, 48, bias=True, dtype=dtype)
    x = torch.randn(FEW_ROWS + 50, 64, dtype=dtype)
    want = F.linear(x.double(), layer.weight.double(), layer.bias.double())
    tolerance = 1e-4 if dtype == torch.float32 else 0.1
    assert torch.allclose(layer(x).double(), want, atol=tolerance)
    if dtype == torch.float32:     # whichever was chosen: oneDNN's product is right (it is in every CPU build)
        assert torch.allclose(onednn_linear(x, layer.weight, layer.bias).double(), want, atol=tolerance)
