"""Attack fixture: library collectives instead of the ring, hidden from the trace (see collectives.py)."""
