"""Submits the reference's own functions instead of writing them."""
