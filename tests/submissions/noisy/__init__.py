"""Correct, but prints warnings to stderr (and chatter to stdout) on every rank."""
