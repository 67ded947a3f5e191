"""The Ulysses widget (reference/widgets/ulysses.py): its layout arithmetic against the reference's
``seq_to_heads`` / ``heads_to_seq`` on real tensors (W = 2, 3, 4 on one world of 4 ranks), the bytes
in its caption against the formula and the run's trace, every frame drawn, and an import that needs
no exercise code."""
from __future__ import annotations

import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from reference.widgets.player import render_png
from reference.widgets.ulysses import PHASES, draw_ulysses, ulysses_caption, ulysses_player, ulysses_state

ROOT = Path(__file__).resolve().parents[2]
CASES = [(2, 8, 4), (3, 12, 6), (4, 8, 8)]          # (W, S, H): W divides both
B, D = 2, 3


def code(batch, tokens, heads) -> torch.Tensor:
    """The value that names (batch row, global token, global head): every element says where it came from."""
    return (batch * 10_000 + tokens * 100 + heads).double()


def sequence_sharded(r: int, W: int, S: int, H: int) -> torch.Tensor:
    """Rank r's (B, H, S/W, D) shard, every element its own code."""
    n = S // W
    b, h, t = torch.meshgrid(torch.arange(B), torch.arange(H), torch.arange(r * n, (r + 1) * n), indexing="ij")
    return code(b, t, h).unsqueeze(-1).expand(B, H, n, D).contiguous()


def head_sharded(g: int, W: int, S: int, H: int) -> torch.Tensor:
    """Rank g's (B, H/W, S, D) output for its head group, every element its own code."""
    h = H // W
    b, hh, t = torch.meshgrid(torch.arange(B), torch.arange(g * h, (g + 1) * h), torch.arange(S), indexing="ij")
    return code(b, t, hh).unsqueeze(-1).expand(B, h, S, D).contiguous()


def ulysses_blocks_worker(W: int, S: int, H: int) -> dict | None:
    """The reference's two all-to-alls on ranks 0 … W−1 on coded tensors."""
    from reference import comm
    from reference.sequence.ulysses import heads_to_seq, seq_to_heads
    group = comm.first_ranks_group(W)
    r = comm.rank()
    if r >= W:
        return None
    return {"to_heads": seq_to_heads(sequence_sharded(r, W, S, H), group),
            "to_seq": heads_to_seq(head_sharded(r, W, S, H), group)}


def _block_of(t: torch.Tensor, blk: dict) -> torch.Tensor:
    (h0, h1), (t0, t1) = blk["local_heads"], blk["local_tokens"]
    return t[:, h0:h1, t0:t1]


def _expected(blk: dict) -> torch.Tensor:
    (h0, h1), (t0, t1) = blk["heads"], blk["tokens"]
    b, h, t = torch.meshgrid(torch.arange(B), torch.arange(h0, h1), torch.arange(t0, t1), indexing="ij")
    return code(b, t, h).unsqueeze(-1).expand(-1, -1, -1, D)


def _covers(blocks: list[dict], shape: tuple[int, ...]) -> bool:
    seen = torch.zeros(shape[1], shape[2], dtype=torch.int64)
    for blk in blocks:
        (h0, h1), (t0, t1) = blk["local_heads"], blk["local_tokens"]
        seen[h0:h1, t0:t1] += 1
    return bool((seen == 1).all())


@pytest.fixture(scope="module")
def runs(world):
    w = world(4)
    return {W: w.run(ulysses_blocks_worker, W, S, H) for W, S, H in CASES}


@pytest.mark.parametrize("W,S,H", CASES)
def test_every_block_lands_where_seq_to_heads_puts_it(runs, W, S, H):
    res = runs[W]
    before, moved, after = (ulysses_state(s, world_size=W, seq_len=S, heads=H) for s in (0, 1, 2))
    assert moved["holds"] == after["holds"] and moved["before"] == before["holds"]
    for r in range(W):
        x = sequence_sharded(r, W, S, H)
        assert _covers(before["holds"][r], x.shape)
        for blk in before["holds"][r]:                        # what rank r hands in ...
            assert torch.equal(_block_of(x, blk), _expected(blk)) and blk["colour"] == r
        y = res.values[r]["to_heads"]
        assert y.shape == (B, H // W, S, D) and _covers(after["holds"][r], y.shape)
        for blk in after["holds"][r]:                         # ... and what arrives, coloured by its sender
            assert torch.equal(_block_of(y, blk), _expected(blk)), (W, r, blk["label"])
            assert blk["colour"] == blk["chunk"]
    # every block moves from the rank whose tokens it holds to the rank of its head group, once
    assert sorted((m["src"], m["dst"]) for m in moved["moves"]) == sorted((w, g) for w in range(W) for g in range(W))
    for m in moved["moves"]:
        assert (m["src"], m["dst"]) == (m["chunk"], m["group"])
        assert any(b["chunk"] == m["chunk"] and b["group"] == m["group"] for b in after["holds"][m["dst"]])


@pytest.mark.parametrize("W,S,H", CASES)
def test_the_inverse_puts_every_block_back_where_heads_to_seq_does(runs, W, S, H):
    res = runs[W]
    attn, inverse, back = (ulysses_state(s, world_size=W, seq_len=S, heads=H) for s in (3, 4, 5))
    assert inverse["before"] == attn["holds"] and inverse["holds"] == back["holds"]
    for r in range(W):
        out = head_sharded(r, W, S, H)
        for blk in attn["holds"][r]:
            assert torch.equal(_block_of(out, blk), _expected(blk))
        z = res.values[r]["to_seq"]
        assert z.shape == (B, H, S // W, D) and _covers(back["holds"][r], z.shape)
        for blk in back["holds"][r]:
            assert torch.equal(_block_of(z, blk), _expected(blk)), (W, r, blk["label"])
            assert blk["colour"] == blk["group"]
    assert all((m["src"], m["dst"]) == (m["group"], m["chunk"]) for m in inverse["moves"])


@pytest.mark.parametrize("W,S,H", CASES)
def test_off_rank_bytes_are_the_formula_and_what_the_run_sent(runs, W, S, H):
    st = ulysses_state(1, world_size=W, seq_len=S, heads=H, head_dim=D, bytes_per_value=8, batch=B)
    shard = B * (S // W) * H * D * 8
    assert st["bytes"]["shard"] == shard and st["bytes"]["formula"] == Fraction(W - 1, W) * shard
    assert st["bytes"]["off_rank"] == {r: st["bytes"]["formula"] for r in range(W)}
    for what, step in (("seq_to_heads", 1), ("heads_to_seq", 4)):
        st = ulysses_state(step, world_size=W, seq_len=S, heads=H, head_dim=D, bytes_per_value=8, batch=B)
        for e in runs[W].trace.filter(op="all_to_all"):
            if e.meta.get("what") == what:
                sent = sum(b for dst, b in enumerate(e.meta["send_bytes"]) if dst != e.rank)
                assert (e.nbytes, sent) == (st["bytes"]["shard"], st["bytes"]["off_rank"][e.rank])


@pytest.mark.parametrize("W,S,H,Dh,b", [(2, 256, 4, 16, 4), (4, 256, 4, 16, 4), (3, 12, 6, 8, 2)])
def test_the_caption_states_the_formula_and_its_value(W, S, H, Dh, b):
    n = S // W
    per = (W - 1) * n * H * Dh * b // W
    sizes = dict(world_size=W, seq_len=S, heads=H, head_dim=Dh, bytes_per_value=b)
    text = ulysses_caption(ulysses_state(1, **sizes))
    assert f"(W−1)/W·n·H·D·b = {W - 1}/{W}·{n}·{H}·{Dh}·{b} = {per:,} B" in text
    assert f"sends {per:,} B of it off-rank" in text and f"× 3 (q, k, v) = {3 * per:,} B" in text
    assert f"= {per:,} B" in ulysses_caption(ulysses_state(4, **sizes))
    totals = [ulysses_state(s, **sizes)["bytes"]["so_far"] for s in range(len(PHASES))]
    assert totals == [0, 3 * per, 3 * per, 3 * per, 4 * per, 4 * per]
    # the notebook's per-forward formula, (W−1)/W·n·(2H + 2H_kv)·D·b with H_kv = H
    assert f"of {(W - 1) * n * 4 * H * Dh * b // W:,} B per forward" in ulysses_caption(ulysses_state(5, **sizes))
    assert "off-rank" not in ulysses_caption(ulysses_state(2, **sizes)).split(" · ")[1]


@pytest.mark.parametrize("W,S,H", CASES)
def test_every_frame_draws(W, S, H):
    for step in range(len(PHASES)):
        st = ulysses_state(step, world_size=W, seq_len=S, heads=H)
        assert render_png(draw_ulysses, st, figsize=(8, 4), dpi=30).startswith(b"\x89PNG")
    assert ulysses_state(99, world_size=W, seq_len=S, heads=H)["phase"] == "back"


def test_sizes_ulysses_cannot_split_are_refused():
    with pytest.raises(ValueError, match="W to divide H"):
        ulysses_state(0, world_size=4, heads=6)
    with pytest.raises(ValueError, match="multiple of 3"):
        ulysses_state(0, world_size=3, seq_len=256, heads=6)
    with pytest.raises(ValueError, match="must divide"):
        ulysses_player(world_size=3)


def test_the_widget_needs_no_exercise_code():
    """Importing it and playing every frame touches neither the learner's package nor reference.sequence."""
    script = ("import sys\n"
              "from reference.widgets.ulysses import PHASES, ulysses_player\n"
              "p = ulysses_player(world_size=2)\n"
              "assert p.n_steps == len(PHASES) and p.png(1).startswith(b'\\x89PNG')\n"
              "p.widget(); p.controls['world_size'].value = 4; p.show(4)\n"
              "print(sorted(m for m in sys.modules if m.startswith(('exercises', 'reference.sequence'))))\n")
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
