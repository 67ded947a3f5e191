"""0.1 loops forever on a single rank (no communication); 0.2 is correct."""
