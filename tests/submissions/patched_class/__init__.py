"""3.2 by patching a given class: at import, ``DataParallel._finish`` (the end-of-backward callback)
is replaced by one that all-reduces every gradient itself, so DataParallel's values come out right
while grad_ready and finish_buckets do nothing.  The grader restores the given code before every
call and refuses a result computed with a changed one."""
