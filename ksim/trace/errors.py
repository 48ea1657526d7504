"""Errors of ``ksim trace``: each names where in the program it arose, and prints
the way bpftrace's language reports errors::

    stdin:1:12-17: ERROR: syntax error, unexpected ')', expecting an expression
    kprobe:f { @ = ); }
               ~~~~~
"""

from __future__ import annotations

from dataclasses import dataclass

from ksim.errors import KsimError


@dataclass(frozen=True, slots=True)
class Loc:
    """A span of the program: 1-based line and columns, ``end`` exclusive."""

    line: int
    col: int
    end: int

    def to(self, other: Loc) -> Loc:
        """From this span's start to ``other``'s end (on this span's line)."""
        end = other.end if other.line == self.line else self.col + 1
        return Loc(self.line, self.col, max(end, self.col + 1))


class TraceError(KsimError):
    """A program ``ksim trace`` cannot run; ``loc`` is where (None: the whole program)."""

    code = "trace"

    def __init__(self, message: str, loc: Loc | None = None) -> None:
        self.message = message
        self.loc = loc
        self.source: str | None = None
        self.filename = "stdin"
        super().__init__(message)

    def located(self, source: str, filename: str) -> TraceError:
        """This error, told where the program came from (for ``__str__``)."""
        self.source, self.filename = source, filename
        return self

    def __str__(self) -> str:
        if self.loc is None:
            return f"{self.filename}: ERROR: {self.message}"
        loc = self.loc
        head = f"{self.filename}:{loc.line}:{loc.col}-{loc.end}: ERROR: {self.message}"
        lines = (self.source or "").splitlines()
        if not 0 < loc.line <= len(lines):
            return head
        text = lines[loc.line - 1]
        marks = " " * (loc.col - 1) + "~" * max(1, loc.end - loc.col)
        return f"{head}\n{text}\n{marks}"


class TraceSyntaxError(TraceError):
    """The program does not parse."""

    code = "trace-syntax"


class TraceUnsupported(TraceError):
    """A construct of bpftrace's language outside the subset ``ksim trace`` implements."""

    code = "trace-unsupported"


class TraceSemanticError(TraceError):
    """The program parses but means nothing: an unknown builtin, a type mismatch, ..."""

    code = "trace-semantic"


__all__ = ["Loc", "TraceError", "TraceSemanticError", "TraceSyntaxError", "TraceUnsupported"]
