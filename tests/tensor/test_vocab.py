"""Vocabulary-parallel embedding and cross-entropy (reference.tensor.vocab) against nn.Embedding and
F.cross_entropy(reduction="none"), float64 at 1e-12, W = 1, 2, 3, 4, logits ×30, targets at every
shard edge and an ignored token; exactly three all-reduces of one number per token for the loss."""
import pytest
import torch
import torch.nn.functional as F

from reference.tensor import vocab_parallel_cross_entropy, workers

TOL = dict(atol=1e-12, rtol=1e-12)


def truth(v):
    """Single-process loss, logits gradient, embedding output and gradient from the worker's inputs."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(12, 4, dtype=torch.float64)
    e = emb(v["ids"])
    e.backward(v["demb"])
    z = v["logits"].clone().requires_grad_()
    loss = F.cross_entropy(z, v["target"], reduction="none")
    loss.backward(v["dloss"])
    return loss.detach(), z.grad, e.detach(), emb.weight.grad


@pytest.mark.parametrize("W", [1, 2, 3, 4])
def test_embedding_and_cross_entropy_match_single_process(world, W):
    res = world(W).run(workers.vocab, V=12, d=4, tokens=10, seed=0, scale=30.0, ignore=(9,))
    loss, dz, e, demb = truth(res.values[0])
    assert torch.isfinite(loss).all() and loss[9] == 0
    n = 12 // W
    for r, v in enumerate(res.values):
        torch.testing.assert_close(v["loss"], loss, **TOL)
        torch.testing.assert_close(v["dlogits"], dz[:, r * n:(r + 1) * n], **TOL)
        torch.testing.assert_close(v["emb"], e, **TOL)
        torch.testing.assert_close(v["emb_grad"], demb[r * n:(r + 1) * n], **TOL)
    assert set(res.values[0]["target"][:2 * W].tolist()) == {i for r in range(W) for i in (r * n, r * n + n - 1)}


@pytest.mark.parametrize("W", [2, 4])
def test_loss_sends_three_all_reduces_of_one_number_per_token(world, W):
    res = world(W).run(workers.vocab, V=12, d=4, tokens=10)
    for r in range(W):
        loss = res.trace.filter(rank=r, layer="loss")
        assert [(e.op, e.meta["what"], e.nbytes) for e in loss] == [
            ("all_reduce", "max", 80), ("all_reduce", "sum_exp", 80), ("all_reduce", "target_logit", 80)]
        emb = res.trace.filter(rank=r, layer="embedding")
        assert [(e.op, e.nbytes) for e in emb] == [("all_reduce", 10 * 4 * 8)]
        assert len(res.trace.filter(rank=r, op=("all_reduce", "all_gather", "reduce_scatter", "send"))) == 4


def test_single_process_cross_entropy_is_stable_and_exact():
    g = torch.Generator().manual_seed(3)
    z = (torch.randn(6, 10, generator=g, dtype=torch.float64) * 300).requires_grad_()
    t = torch.tensor([0, 9, 4, -100, 5, 1])
    loss = vocab_parallel_cross_entropy(z, t)
    torch.testing.assert_close(loss, F.cross_entropy(z, t, reduction="none"), **TOL)
    loss.sum().backward()
    zz = z.detach().clone().requires_grad_()
    F.cross_entropy(zz, t, reduction="sum").backward()
    torch.testing.assert_close(z.grad, zz.grad, **TOL)


def test_bad_shapes_raise_value_error():
    with pytest.raises(ValueError):
        vocab_parallel_cross_entropy(torch.zeros(4, 3), torch.zeros(5, dtype=torch.long))
