"""The matrix-split widget's pure state function (reference.widgets.matrix_split) on synthetic runs
and on a real one; every frame draws."""
import pytest

from reference.widgets.matrix_split import (draw_matrix_split, matrix_split_caption, matrix_split_player,
                                            matrix_split_state, phases)
from reference.widgets.player import render_png


def _run(sp: bool, tp: int = 2, meta: bool = True):
    S, d, dff = 4, 6, 8
    act = S * d * 8
    if sp:
        cols = [("all_gather", "g-bar", "forward", "mlp.fc1", act // tp),
                ("reduce_scatter", "g", "forward", "mlp.fc2", act),
                ("all_gather", "g", "backward", "mlp.fc2", act // tp),
                ("all_gather", "g-bar", "backward", "mlp.fc1", act // tp),     # fc1's re-gather of its input
                ("reduce_scatter", "g-bar", "backward", "mlp.fc1", act),
                ("all_reduce", "sp-grad-sync", "backward", "", 48)]
    else:
        cols = [("all_reduce", "g", "forward", "mlp.fc2", act), ("all_reduce", "f", "backward", "mlp.fc1", act)]
    cols = [dict(op=o, operator=p if meta else "", direction=dr if meta else "", layer=layer if meta else "", nbytes=n,
                 wire=float(n), what="sp_regather" if meta and i == 3 and sp else "") for i, (o, p, dr, layer, n)
            in enumerate(cols)]
    if not meta:
        cols = [c for c in cols if c["nbytes"] != 48]
    return {"tp": tp, "sequence_parallel": sp, "S": S, "d_model": d, "d_ff": dff, "collectives": cols, "max_error": 0.0}


def test_plain_tp_has_one_all_reduce_after_fc2_forward_and_one_after_fc1_backward():
    ph = phases(_run(False))
    kinds = [(p["kind"], p["direction"], p["block"]) for p in ph]
    comm = [k for k in kinds if k[0] == "comm"]
    assert comm == [("comm", "forward", "Z"), ("comm", "backward", "X")]
    i_fc2 = next(i for i, p in enumerate(ph) if p["block"] == "B" and p["direction"] == "forward")
    assert ph[i_fc2 + 1]["kind"] == "comm" and ph[i_fc2 + 1]["comm"]["op"] == "all_reduce"
    assert ph[-1]["comm"]["operator"] == "f"


def test_sequence_parallel_gathers_before_fc1_and_reduce_scatters_after_fc2():
    ph = phases(_run(True))
    comm = [(p["direction"], p["comm"]["op"], p["block"]) for p in ph if p["kind"] == "comm"]
    assert comm == [("forward", "all_gather", "X"), ("forward", "reduce_scatter", "Z"),
                    ("backward", "all_gather", "out"), ("backward", "all_gather", "X"),
                    ("backward", "reduce_scatter", "X")]
    labels = [p["label"] for p in ph]
    assert labels.index("all-gather X again: fc1 kept only its S/W rows") == labels.index(
        "fc1ᵀ: ∂A_r and a PARTIAL ∂X_r") - 1
    assert ph.index(next(p for p in ph if p["label"].startswith("fc1 column"))) == 2


def test_state_counts_bytes_and_shapes():
    run = _run(True, tp=2)
    last = matrix_split_state(run, 10**6)               # clamps to the last frame
    assert last["step"] == last["n_steps"] - 1 and last["collectives_so_far"] == 5
    assert last["bytes_so_far"] == 96 + 192 + 96 + 96 + 192
    assert last["shapes"]["X"] == (2, 6) and last["shapes"]["A"] == (6, 4) and last["shapes"]["B"] == (4, 6)
    assert matrix_split_state(_run(False), 0)["shapes"]["X"] == (4, 6)


def test_a_run_without_meta_is_placed_by_order():
    assert [p["block"] for p in phases(_run(True, meta=False)) if p["kind"] == "comm"] == \
        [p["block"] for p in phases(_run(True)) if p["kind"] == "comm"]


@pytest.mark.parametrize("sp,tp", [(False, 2), (True, 4), (False, 1)])
def test_every_frame_draws_with_a_caption(sp, tp):
    run = _run(sp, tp)
    for step in range(len(phases(run))):
        st = matrix_split_state(run, step)
        assert matrix_split_caption(st).startswith(f"step {step + 1}/")
        assert render_png(draw_matrix_split, st, figsize=(8, 3.5), dpi=30).startswith(b"\x89PNG")
    assert matrix_split_player({False: _run(False), True: _run(True)}).n_steps == len(phases(_run(False)))


def test_real_run_matches_the_synthetic_layout(world):
    from reference.tensor import lecture
    run = lecture.mlp_run(tp=2, world=world(2))
    assert run["max_error"] < 1e-12
    assert ([(p["direction"], p["block"]) for p in phases(run) if p["kind"] == "comm"]
            == [("forward", "Z"), ("backward", "X")])
    sp = lecture.mlp_run(tp=2, sequence_parallel=True, world=world(2))
    assert sp["max_error"] < 1e-12
    assert ([(p["direction"], p["comm"]["op"], p["block"]) for p in phases(sp) if p["kind"] == "comm"]
            == [(p["direction"], p["comm"]["op"], p["block"]) for p in phases(_run(True)) if p["kind"] == "comm"])
