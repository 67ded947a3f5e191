"""0.1 is a ring of blocking send-then-recv (deadlocks for N > 1); 0.2 is correct."""
