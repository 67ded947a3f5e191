"""Attack fixture (round 3, ``hostile_env``): an honest 5a.1 whose module, as it is imported,
tries to poison the process it runs in and whatever comes after it: torch and numpy patched,
chdir("/"), umask 0o777, PATH/TMPDIR/HOME rewritten, a non-daemon thread re-patching forever, 1.2 GB
touched, a detached (setsid) sleeper, a pickle that runs code planted as exercises/grading/oracle_answers.pt,
sitecustomize.py written into every sys.path folder.  It acts only where the grader runs it as another
user (its HOME is the grader's private scratch folder): graded by hand in a checkout it does nothing.
Its 5c.1 is honest: the next grading."""
