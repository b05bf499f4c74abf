"""Block scores from key summaries: a block one head relies on outranks one that many heads glance at."""
import pytest
import torch

from kvtier.kv.scorer import BlockSummaries, attention_share


@pytest.mark.parametrize("policy", ["quest", "meankey"])
def test_a_block_one_head_relies_on_outranks_one_many_heads_glance_at(policy):
    layers, size, dim = 4, 16, 4
    e0 = torch.eye(dim)[0]
    recalled = torch.zeros(layers, size, 1, dim)
    recalled[0] = 10 * e0           # layer 0 puts nearly all its attention here
    glanced = (1.5 * e0).expand(layers, size, 1, dim)   # layers 1-3 give it about 0.6
    hay = torch.zeros(layers, size, 1, dim)
    summaries = BlockSummaries()
    for keys in (hay, recalled, glanced, hay):
        summaries.add(keys)
    queries = e0.expand(1, layers, 1, dim)      # one row, one query head per KV head

    scores = attention_share(policy, summaries, queries, scale=1.0)

    assert scores.shape == (4,)
    assert scores.argmax() == 1
    assert scores[1] > 0.99 and 0.55 < scores[2] < 0.65      # the largest share any head gives each block
    # summed over the layers, the glanced-at block would have won
    shares = torch.stack([torch.tensor([0.0, 10.0 if layer == 0 else 0.0, 1.5, 0.0]).softmax(0)
                          for layer in range(layers)])
    assert shares.sum(0).argmax() == 2
