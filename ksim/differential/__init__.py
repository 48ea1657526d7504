"""Checks of the engine against itself on real code.

``ksim.differential.harness`` runs a kernel function from a point twice in unicorn,
original and spliced, and compares what the two runs did.
"""

from ksim.differential.harness import (
    KINDS,
    SNIPPETS,
    TACTICS,
    Call,
    Case,
    Exit,
    Harness,
    MemWrite,
    Planned,
    Result,
    Run,
    random_cases,
    run_case,
    tally,
)

__all__ = [
    "KINDS",
    "SNIPPETS",
    "TACTICS",
    "Call",
    "Case",
    "Exit",
    "Harness",
    "MemWrite",
    "Planned",
    "Result",
    "Run",
    "random_cases",
    "run_case",
    "tally",
]
