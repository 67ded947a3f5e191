"""0.1 is wrong (returns its input) and patches the comparisons, the feedback module and the reference; 0.2 is
correct."""
