"""Sleeps an hour when imported (in the runner or a rank): every check would wait its full limit."""
import time

time.sleep(3600)
