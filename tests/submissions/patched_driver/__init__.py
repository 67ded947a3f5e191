"""3.3 by patching the given driver: at import, ``reference.data.workers.train`` becomes a function
that trains the single-process truth (the whole batch, on every rank) — every rank then returns the
right parameters and zero_step is never written.  The grader restores the given code before every
call and refuses a result computed with a changed one."""
