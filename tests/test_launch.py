"""reference.launch: results come back; every failure becomes a WorldError naming ranks, fast,
with no process or port left behind."""
from __future__ import annotations

import socket
import sys
import types

import pytest

from reference import zygote
from reference.launch import World, WorldError, run_world
from tests.workers import launch_workers as W


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def test_values_come_back_in_rank_order(world):
    res = world(3).run(W.rank_and_size, "x")
    assert res.values == [(0, 3, "x"), (1, 3, "x"), (2, 3, "x")]


def test_single_rank_world_runs(world):
    assert world(1).run(W.rank_and_size, 5).values == [(0, 1, 5)]


def test_ranks_use_gloo_on_cpu(world):
    assert world(2).run(W.gloo_device).values == [("cpu", "gloo")] * 2


def test_what_ranks_print_reaches_the_caller_with_their_rank(capsys, world):
    res = world(2).run(W.shout, "hello")
    out = capsys.readouterr().out
    # echo is off for the shared worlds; the output is still returned
    assert "[rank 0] hello from rank 0" in res.output and "[rank 1] hello from rank 1" in res.output
    assert "[rank 1] warning on rank 1" in res.output
    w = World(2, echo=True)
    try:
        w.run(W.shout, "hi")
    finally:
        w.close()
    out = capsys.readouterr().out
    assert "[rank 0] hi from rank 0" in out and "[rank 1] hi from rank 1" in out


def test_what_a_rank_prints_is_kept_up_to_a_limit_so_a_flood_costs_no_memory(world):
    from reference import launch
    res = world(2).run(W.flood, 8)                     # 8 MB from each rank
    assert res.values == [0, 1]
    assert len(res.output) < 2 * launch.OUTPUT_LIMIT * 1.1 + 1000     # the kept text and its "[rank r] " prefixes
    for r in (0, 1):
        assert f"[rank {r}] ... (more output not shown: each rank keeps {launch.OUTPUT_LIMIT // 1024} KiB" in res.output
    small = world(2).run(W.shout, "again")             # the limit is per run: the next run prints again
    assert "[rank 1] again from rank 1" in small.output


@pytest.mark.timeout(60)       # a safety net: the world's own timeout (30 s) would report a hang as "timeout"
def test_exception_names_rank_type_message_and_traceback_and_stops_the_others(no_orphans):
    with pytest.raises(WorldError) as info:
        run_world(W.raise_on, 3, 1, timeout=30)
    e = info.value
    assert isinstance(e, RuntimeError) and e.kind == "exception" and e.ranks == [1]
    assert e.failures[1].exc_type == "ValueError"
    msg = str(e)
    assert "rank 1 raised ValueError: bad shape on rank 1" in msg
    assert "Traceback" in msg and "launch_workers.py" in msg


def test_error_on_every_rank_is_reported_for_every_rank(no_orphans):
    with pytest.raises(WorldError) as info:
        run_world(W.raise_everywhere, 4, timeout=30)
    assert info.value.ranks == [0, 1, 2, 3]
    assert all(f.exc_type == "ValueError" for f in info.value.failures.values())


@pytest.mark.parametrize("worker, how", [(W.kill_self, "SIGKILL"), (W.segfault, "SIGSEGV"),
                                         (W.exit_early, "exited with code 3"), (W.hard_exit, "exited with code 0")])
@pytest.mark.timeout(120)      # a safety net: the world's own timeout (60 s) would report a hang as "timeout"
def test_a_rank_that_dies_is_named_with_how_it_died_within_seconds(worker, how, no_orphans):
    with pytest.raises(WorldError) as info:
        run_world(worker, 3, 2, timeout=60)
    e = info.value
    assert e.kind != "timeout", e
    if worker is W.exit_early:  # sys.exit raises SystemExit inside the rank: reported as an exception
        assert e.kind == "exception" and e.failures[2].exc_type == "SystemExit"
    else:
        assert e.kind == "died" and e.ranks == [2], str(e)
        assert how in str(e)


@pytest.mark.timeout(60)       # a safety net: the world's 3 s timeout is what reports the deadlock
def test_blocking_ring_is_reported_as_deadlock_with_each_ranks_operation(no_orphans):
    with pytest.raises(WorldError) as info:
        run_world(W.blocking_ring, 3, timeout=3)
    e = info.value
    assert e.kind == "timeout" and e.ranks == [0, 1, 2]
    for r in range(3):
        assert e.failures[r].blocked_in == f"send to rank {(r + 1) % 3}"
    assert "blocking send" in str(e)


def test_timeout_names_the_blocked_operation_and_ring_step(no_orphans):
    with pytest.raises(WorldError) as info:
        run_world(W.missing_message, 2, timeout=3)
    e = info.value
    assert e.kind == "timeout" and e.ranks == [0]
    assert e.failures[0].blocked_in == "recv from rank 1 (step 2)"
    assert "ranks 1 had finished" in str(e)


def test_a_rank_that_never_finishes_is_reported_as_running(no_orphans):
    with pytest.raises(WorldError) as info:
        run_world(W.spin, 2, timeout=2)
    assert info.value.kind == "timeout"
    assert "no communication in progress" in str(info.value)


def test_bad_arguments_raise_value_error_before_anything_starts(no_orphans):
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="world_size"):
            run_world(W.rank_and_size, bad, 1)
    with pytest.raises(ValueError, match="lambda"):
        run_world(lambda: 1, 2)

    def nested():
        return 1
    with pytest.raises(ValueError, match="nested|lambda"):
        run_world(nested, 2)
    with pytest.raises(ValueError, match="arguments"):
        run_world(W.rank_and_size, 2, (x for x in range(3)))


def test_function_from_a_notebook_cell_is_refused_with_advice(monkeypatch):
    fake_main = types.ModuleType("__main__")  # like a Jupyter kernel's: no __file__
    monkeypatch.setitem(sys.modules, "__main__", fake_main)

    def cell_fn():
        return 1
    cell_fn.__module__ = "__main__"
    cell_fn.__qualname__ = "cell_fn"
    with pytest.raises(ValueError, match="notebook cell"):
        run_world(cell_fn, 2)


def test_unpicklable_return_value_is_a_clear_error(no_orphans):
    with pytest.raises(WorldError, match="cannot be sent back"):
        run_world(W.unpicklable_result, 1)


def test_port_is_released_and_no_process_left_after_success_and_failure(no_orphans):
    w = World(2)
    w.start()
    port = w.port
    assert not port_is_free(port)
    w.run(W.rank_and_size, 1)
    w.close()
    assert port_is_free(port)
    w2 = World(2, timeout=2)
    w2.start()
    port2 = w2.port
    with pytest.raises(WorldError):
        w2.run(W.spin)
    assert port_is_free(port2)


def test_each_world_gets_its_own_port():
    a, b = World(1).start(), World(1).start()
    try:
        assert a.port != b.port
    finally:
        a.close()
        b.close()


def test_kept_alive_world_runs_again_in_the_same_processes_and_restarts_after_failure(no_orphans):
    with World(2, timeout=3) as w:
        first = w.run(W.pid, 0).values
        assert w.run(W.pid, 1).values == first            # the same ranks: no start-up cost the second time
        with pytest.raises(WorldError):
            w.run(W.raise_on, 0)
        assert w.run(W.rank_and_size, 2).values == [(0, 2, 2), (1, 2, 2)]


def test_raw_batch_isend_irecv_is_traced_and_a_second_wait_does_not_hang(world):
    res = world(3).run(W.raw_p2p_ring, 8, timeout=10)
    assert res.values == [2.0, 0.0, 1.0]
    sends = res.trace.filter(op="send")
    assert sorted((e.rank, e.peer, e.nbytes) for e in sends) == [(0, 1, 32), (1, 2, 32), (2, 0, 32)]


def test_subgroups_get_the_worlds_timeout_not_torchs_30_minutes(world):
    values = world(2).run(W.subgroup_timeout).values
    assert values == [120.0, 120.0]   # session worlds: timeout=60 s, process groups max(2·60, 120) s


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_ranks_keep_freed_memory_for_the_next_step_unless_told_not_to(monkeypatch, no_orphans):
    """A 20 MB block a rank frees stays in its heap for the next step (no fresh pages to fault in);
    with COURSE_KEEP_FREED_MEMORY=0 glibc maps and unmaps it, its default."""
    with World(2, timeout=30) as world:
        assert world.run(W.freed_block_stays_in_the_heap).values == [(False, True)] * 2
    with World(1, timeout=30, keep_freed_memory=False) as world:            # forked, glibc's thresholds set
        assert world.run(W.freed_block_stays_in_the_heap).values == [(True, False)]
    monkeypatch.setenv("COURSE_KEEP_FREED_MEMORY", "0")
    with World(1, timeout=30) as world:
        assert world.run(W.freed_block_stays_in_the_heap).values == [(True, False)]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_a_rank_that_returns_freed_memory_maps_what_it_holds(no_orphans):
    """The grader's memory checks cap the address space: after return_freed_memory a freed 1 MiB block is
    given back (a rank that keeps freed memory keeps it in its heap, where the cap would still count it)."""
    with World(1, timeout=30) as world:
        assert world.run(W.freed_block_stays_in_the_heap, 1 << 20).values == [(False, True)]
    with World(1, timeout=30) as world:          # (a heap that holds a free block already would serve it again)
        assert world.run(W.freed_block_after_return_freed_memory, 1 << 20).values == [(True, True)]


def test_a_kept_alive_world_runs_the_edit_of_a_module_its_ranks_imported(tmp_path, monkeypatch, capsys, no_orphans):
    """A learner fixes their exercise and runs the demo cell again: the kept-alive ranks had imported the
    old file, so the world starts afresh, says why, and runs the edit; an unchanged file keeps the ranks."""
    import importlib
    source = tmp_path / "edited_by_the_learner.py"
    source.write_text("def answer():\n    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("edited_by_the_learner")
    with World(2, timeout=30) as w:
        assert w.run(module.answer).values == [1, 1]
        ranks = w.run(W.pid, 0).values
        assert w.run(module.answer).values == [1, 1] and w.run(W.pid, 0).values == ranks   # nothing changed
        capsys.readouterr()
        source.write_text("def answer():\n    return 22\n")
        assert w.run(module.answer).values == [22, 22]
        assert "edited_by_the_learner.py changed since these ranks imported it" in capsys.readouterr().out
        assert set(w.run(W.pid, 0).values).isdisjoint(ranks)


def test_a_world_that_runs_once_reports_no_sources_and_a_kept_alive_one_does(tmp_path, monkeypatch, no_orphans):
    """``watch_sources=False`` (run_world, the grader's worlds): the ranks skip the report, ~15 ms each."""
    import importlib
    (tmp_path / "imported_by_the_ranks.py").write_text("def answer():\n    return 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("imported_by_the_ranks")
    with World(1, timeout=30) as kept, World(1, timeout=30, watch_sources=False) as once:
        assert kept.run(module.answer).values == once.run(module.answer).values == [3]
        assert str((tmp_path / "imported_by_the_ranks.py").resolve()) in kept._sources
        assert once._sources == {}


def test_a_source_path_resolves_as_realpath_through_linked_folders_and_files(tmp_path):
    """reference.sources resolves a module's file with one lstat (its folder's resolution cached), yet as
    os.path.realpath does: a linked folder, a linked file, a link to a link; an installed file is None."""
    import os
    import site

    from reference import sources
    real = tmp_path / "real"
    real.mkdir()
    (real / "mod.py").write_text("")
    (tmp_path / "folder_link").symlink_to(real)
    (real / "file_link.py").symlink_to(real / "mod.py")
    (tmp_path / "link_to_link.py").symlink_to(real / "file_link.py")
    for path in (real / "mod.py", tmp_path / "folder_link" / "mod.py", tmp_path / "folder_link" / "file_link.py",
                 tmp_path / "link_to_link.py"):
        assert sources._editable_source(str(path)) == os.path.realpath(path) == str(real / "mod.py")
    assert sources._editable_source(os.__file__) is None
    assert sources._editable_source(os.path.join(site.getsitepackages()[0], "x.py")) is None


@pytest.mark.skipif(not zygote.available(), reason="ranks are forked on Linux only, unless COURSE_FORK_RANKS=0")
def test_ranks_are_forked_from_one_zygote_and_glibcs_moving_defaults_alone_spawn_them(monkeypatch, no_orphans):
    from reference.zygote import zygote_pid
    import os
    with World(2, timeout=30) as a, World(1, timeout=30, keep_freed_memory=False) as b:
        parents = a.run(W.parent_pid).values + b.run(W.parent_pid).values
    assert zygote_pid() is not None and parents == [zygote_pid()] * 3
    monkeypatch.setenv("COURSE_KEEP_FREED_MEMORY", "0")
    with World(1, timeout=30) as c:
        assert c.run(W.parent_pid).values == [os.getpid()]


@pytest.mark.skipif(not zygote.available(), reason="ranks are forked on Linux only, unless COURSE_FORK_RANKS=0")
def test_a_forked_rank_reads_torch_distributed_debug_from_its_own_environment(monkeypatch, no_orphans):
    with World(1, timeout=30) as plain:                 # the zygote starts without DETAIL
        assert plain.run(W.debug_level).values == ["DebugLevel.OFF"]
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    with World(1, timeout=30) as detail:
        assert detail.run(W.parent_pid).values == [zygote.zygote_pid()]
        assert detail.run(W.debug_level).values == ["DebugLevel.DETAIL"]


@pytest.mark.skipif(not zygote.available(), reason="ranks are forked on Linux only, unless COURSE_FORK_RANKS=0")
def test_a_killed_zygote_takes_its_ranks_along_and_the_next_run_gets_a_new_one(no_orphans):
    import os
    import signal
    from reference.zygote import zygote_pid
    with World(2, timeout=30) as w:
        ranks = w.run(W.pid, 0).values
        old = zygote_pid()
        os.kill(old, signal.SIGKILL)
        assert _gone(ranks), "the ranks outlived their zygote"
        assert w.run(W.rank_and_size, 2).values == [(0, 2, 2), (1, 2, 2)]     # fresh ranks, a fresh zygote
        assert zygote_pid() not in (None, old)


def _gone(pids, seconds: float = 10.0) -> bool:
    """Whether every process in ``pids`` has exited (zombies count as gone) within ``seconds``."""
    import time

    def alive(p):
        try:
            with open(f"/proc/{p}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False
    deadline = time.monotonic() + seconds
    while any(alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


_STARTER = """
import os, sys, time
from reference.launch import World
from reference.zygote import zygote_pid
w = World(2, timeout=30, echo=False).start()
print(zygote_pid(), *w.run(os.getpid).values, flush=True)
time.sleep(60)
"""


@pytest.mark.skipif(not zygote.available(), reason="ranks are forked on Linux only, unless COURSE_FORK_RANKS=0")
def test_when_the_process_that_started_a_world_is_killed_its_zygote_and_ranks_go_too(tmp_path):
    import subprocess
    proc = subprocess.Popen([sys.executable, "-c", _STARTER], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(x) for x in proc.stdout.readline().split()]
    finally:
        proc.kill()
        proc.wait()
    assert len(pids) == 3 and _gone(pids), "the zygote or a rank outlived the process that started them"
