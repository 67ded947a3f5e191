"""0.1 is wrong (returns its input) and tries to write a perfect results.json; 0.2 is correct."""
