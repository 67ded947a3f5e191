"""Lecture 4a's exercises, grader and widget: the reference scores full marks, the stubs zero, each
classic mistake is named, and the stubs keep the reference's contract."""
import inspect
import textwrap

import pytest

import exercises.tensor as stubs
import reference.tensor as ref
from tests.conftest import grade_mutant

IDS = ["4.1", "4.2", "4.3"]
GRADED = ["copy_to_tensor_region", "reduce_from_tensor_region", "linear_shard", "column_parallel_linear",
          "row_parallel_linear", "vocab_parallel_cross_entropy"]


def test_exercise_stubs_have_the_reference_signatures_and_docstrings():
    for name in GRADED:
        a, b = getattr(stubs, name), getattr(ref, name)
        assert inspect.signature(a) == inspect.signature(b), name
        assert a.__doc__ == b.__doc__, name
        n_args = len([p for p in inspect.signature(a).parameters.values()
                      if p.default is inspect.Parameter.empty and p.kind == p.POSITIONAL_OR_KEYWORD])
        with pytest.raises(NotImplementedError, match=r"Exercise 4\.\d"):
            a(*[None] * n_args)


@pytest.mark.slow
def test_reference_scores_full_marks_and_stubs_score_zero(course_grades):
    got = {r.exercise.id: r for r in course_grades("reference")[0]}
    for i in IDS:
        assert got[i].score == got[i].max_score > 0, [c.message for c in got[i].checks if not c.passed]
    st = {r.exercise.id: r for r in course_grades("exercises")[0]}
    assert all(st[i].score == 0 for i in IDS)


# ----------------------------------------------------------------------------------------------
# Mutants: a correct submission (the reference's bodies, copied) with one classic mistake


def _correct_module() -> str:
    head = ("import torch\nimport torch.nn.functional as F\nfrom reference import comm\n"
            "from reference.tensor.regions import (gather_from_sequence_region, gather_from_tensor_region,\n"
            "    reduce_scatter_to_sequence_region, scatter_to_tensor_region)\n")
    return head + "\n\n".join(inspect.getsource(getattr(ref, n)) for n in GRADED)


MUTANTS = {
    "f_without_backward_all_reduce": ("4.1", "partial sum", '''
        def copy_to_tensor_region(x, group=None, **meta):
            return x.view_as(x)
        '''),
    "g_all_reduces_both_ways": ("4.1", "too large", '''
        def reduce_from_tensor_region(x, group=None, **meta):
            class G(torch.autograd.Function):
                @staticmethod
                def forward(ctx, x):
                    return comm.all_reduce(x.clone(), group=group)
                @staticmethod
                def backward(ctx, grad):
                    return comm.all_reduce(grad.clone(), group=group)
            return G.apply(x)
        '''),
    "bias_on_every_rank": ("4.2", "bias was added on every rank", '''
        def row_parallel_linear(x, weight, bias=None, group=None, *, input_is_parallel=True,
                                sequence_parallel=False, **meta):
            return reduce_from_tensor_region(F.linear(x, weight, bias), group)
        '''),
    "shards_swapped": ("4.2", "column-parallel cuts the OUTPUT features", '''
        _right = linear_shard
        def linear_shard(weight, bias, style, group=None):
            w, _ = _right(weight, bias, "row" if style == "column" else "column", group)
            return w, _right(weight, bias, style, group)[1]
        '''),
    "cross_entropy_without_max": ("4.3", "GLOBAL max", '''
        def vocab_parallel_cross_entropy(logits_shard, target, group=None, ignore_index=-100):
            W, r, n = comm.world_size(group), comm.rank(group), logits_shard.shape[1]
            s = logits_shard.exp().sum(1)
            s = comm.all_reduce(s.detach(), group=group) - s.detach() + s
            local = target - r * n
            mine = (local >= 0) & (local < n)
            zt = torch.where(mine, logits_shard.gather(1, local.clamp(0, n - 1)[:, None])[:, 0], torch.zeros_like(s))
            zt = comm.all_reduce(zt.detach(), group=group) - zt.detach() + zt
            return torch.where(target == ignore_index, torch.zeros_like(s), s.log() - zt)
        '''),
}


@pytest.mark.slow
@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_grader_names_the_classic_mistake(tmp_path, monkeypatch, mutant):
    ex_id, words, body = MUTANTS[mutant]
    failed = grade_mutant(tmp_path, monkeypatch, f"tensor_mutant_{mutant}", "tensor",
                          _correct_module() + "\n\n" + textwrap.dedent(body), ex_id, hidden=False)
    assert any(words in m for m in failed), failed


def test_collectives_that_do_not_say_their_direction_get_it_from_the_backwards_start(world):
    """A learner's f and g pass no direction=: the block-costs table still splits forward from backward."""
    from dataclasses import replace

    from reference.tensor.lecture import directed
    from reference.tensor.workers import block_worker
    from reference.trace import Trace
    trace = world(2).run(block_worker, 2, True, 16, 2, 32, 4).trace
    bare = Trace(replace(e, meta={k: v for k, v in e.meta.items() if k != "direction"}) for e in trace)
    want = directed(trace, 2)
    assert {c["direction"] for c in want} == {"forward", "backward"}
    assert [c["direction"] for c in directed(bare, 2)] == [c["direction"] for c in want]
