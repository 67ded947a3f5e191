"""Attack fixture (round 3, ``inplace_input``): 0.1's ring is honest, but the sum is written into the
input tensor and that tensor returned (0.2 honest too)."""
