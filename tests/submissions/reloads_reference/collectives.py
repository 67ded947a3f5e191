"""Wants the reference's solution without writing it: reloads the reference module (fresh function
objects built from its source file), or drops every ``reference.*`` module and imports it again, or
loads the file the module came
from under another name.  (Reading the bundle's own files by path is stopped by their permissions,
see lock_source.sh and tests/grading/test_autograder.py.)"""
import importlib
import importlib.util
import sys


def _candidates():
    mod = importlib.reload(importlib.import_module("reference.collectives"))
    yield mod
    for name in [m for m in sys.modules if m == "reference" or m.startswith("reference.")]:
        sys.modules.pop(name)
    fresh = importlib.import_module("reference.collectives")
    yield fresh
    spec = importlib.util.spec_from_file_location("_stolen", fresh.__file__)
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    yield m


def _steal(name):
    def call(*args, **kwargs):
        last = None
        for mod in _candidates():
            try:
                return getattr(mod, name)(*args, **kwargs)
            except Exception as e:      # a stub or a delegation back here: try the next one
                last = e
        raise last
    call.__name__ = name
    return call


ring_all_reduce = _steal("ring_all_reduce")
ring_all_gather = _steal("ring_all_gather")
ring_reduce_scatter = _steal("ring_reduce_scatter")
