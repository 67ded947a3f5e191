"""reference.gpt: the single-process tiny GPT that composed runs are checked against (lecture 5c)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from reference.gpt import GPTConfig, MoEMLP, TinyGPT, corpus, encode, get_batch, train_single


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One thread, as every rank of a world runs (a shared 2-core machine spins OpenMP threads)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


SMALL = dict(d_model=32, heads=4, layers=4, d_ff=64, seq_len=32)   # ~35K parameters: seconds to train


def test_default_size_is_a_few_hundred_thousand_parameters_with_the_names_the_lectures_swap():
    _, alphabet = encode(corpus())
    model = TinyGPT(GPTConfig(vocab=len(alphabet)))
    n = sum(p.numel() for p in model.parameters())
    assert 100_000 < n < 1_000_000, n
    names = {name for name, _ in model.named_parameters()}
    for want in ("blocks.0.attn.qkv.weight", "blocks.0.attn.proj.weight", "blocks.0.mlp.fc1.weight",
                 "blocks.0.mlp.fc2.weight", "tok_emb.weight", "pos_emb.weight", "head.weight"):
        assert want in names
    moe = TinyGPT(GPTConfig(vocab=len(alphabet), num_experts=4))
    assert [isinstance(b.mlp, MoEMLP) for b in moe.blocks] == [False, True, False, True]


def test_corpus_and_batches_are_deterministic():
    assert corpus() == corpus() and 10_000 < len(corpus()) < 30_000
    data, alphabet = encode(corpus())
    assert "".join(alphabet[i] for i in data[:40].tolist()) == corpus()[:40]
    x, y = get_batch(data, step=3, batch_size=4, seq_len=16)
    x2, y2 = get_batch(data, step=3, batch_size=4, seq_len=16)
    assert torch.equal(x, x2) and torch.equal(y, y2) and x.shape == (4, 16)
    assert torch.equal(x[:, 1:], y[:, :-1])                                       # targets = next character
    assert not torch.equal(x, get_batch(data, step=4, batch_size=4, seq_len=16)[0])


def test_attention_is_causal_multi_head_attention():
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab=27, **SMALL)).double()
    attn = model.blocks[0].attn
    x = torch.randn(2, 16, 32, dtype=torch.float64) * 4                            # large logits
    q, k, v = attn.qkv(x).split(32, dim=-1)
    q, k, v = (t.view(2, 16, 4, 8).transpose(1, 2) for t in (q, k, v))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 16, 32)
    torch.testing.assert_close(attn(x), attn.proj(want), rtol=1e-12, atol=1e-12)
    # no token sees the future: changing the last input token changes only the last logits
    idx = torch.randint(0, 27, (2, 16))
    idx2 = idx.clone()
    idx2[:, -1] = (idx[:, -1] + 1) % 27
    out, out2 = model(idx), model(idx2)
    assert torch.equal(out[:, :-1], out2[:, :-1]) and not torch.equal(out[:, -1], out2[:, -1])


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_it_trains_loss_goes_down_over_20_steps(moe):
    kw = dict(SMALL, num_experts=4, top_k=2) if moe else SMALL
    losses = train_single(20, lr=1e-2, **kw)
    assert len(losses) == 20 and all(math.isfinite(x) for x in losses)
    assert abs(losses[0] - math.log(27)) < 0.5                                     # starts near uniform
    assert sum(losses[-5:]) / 5 < losses[0] - 0.5, losses


def test_training_is_deterministic():
    a = train_single(3, **SMALL)
    b = train_single(3, **SMALL)
    assert a == b
    assert train_single(3, seed=1, **SMALL) != a


def test_bad_sizes_raise_value_error():
    with pytest.raises(ValueError, match="d_model=30 must be divisible by heads=4"):
        GPTConfig(vocab=27, d_model=30, heads=4)
    with pytest.raises(ValueError, match="longer than seq_len=32"):
        TinyGPT(GPTConfig(vocab=27, **SMALL))(torch.zeros(1, 33, dtype=torch.long))
