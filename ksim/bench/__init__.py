"""Benchmarks: jmp versus trap splicing, re-measuring the trap paper on modern kernels.

One module per benchmark (sizes, offset, coverage, perhit, batch, analysis); the
runner and the JSON schema are in runner.py and common.py.  ``ksim bench NAME``
runs them.
"""
