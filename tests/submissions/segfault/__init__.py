"""0.1 crashes rank 1 with a segfault on 3 ranks; 0.2 is correct."""
