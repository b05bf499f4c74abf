"""The decoder's own layers against their plain definitions."""
import pytest
import torch
import torch.nn.functional as F

from kvtier.models.decoder import SMALL_ROWS, Linear


@pytest.mark.parametrize("bias", [False, True])
def test_linear_gives_f_linear_for_every_row_count(bias):
    """Few rows (decode steps of a few sequences) take another product on CPU: the same values, contiguous."""
    torch.manual_seed(0)
    layer = Linear(96, 200, bias=bias)
    for rows in range(1, SMALL_ROWS + 3):
        x = torch.randn(rows, 96, dtype=torch.float64).float()
        got = layer(x)
        assert got.is_contiguous() and got.shape == (rows, 200)
        assert torch.allclose(got.double(), F.linear(x.double(), layer.weight.double(),
                                                     None if layer.bias is None else layer.bias.double()), atol=1e-5)
