"""Why the kernel's text at an address must stay as it is: one vocabulary, one verdict.

A *hazard* is a reason the kernel itself relies on an instruction staying where
it is and as it is.  They come from the kernel image's own tables (read by
``ksim.image.tables``), from ksim's blacklist, and on a live kernel from the
kernel itself (the kerninst module answers with the same names).  The planner
never overwrites nor moves an instruction that has one; when the point's own
instruction has one, every tactic would move it, so the point is refused with
the error class named here.

The checks follow kprobes' ``check_kprobe_address_safe()`` (kernel/kprobes.c):
ftrace locations, the kprobes blacklist, ``jump_label_text_reserved``,
``static_call_text_reserved``, ``find_bug``, and x86 optprobes'
``search_exception_tables`` for every instruction they would move
(arch/x86/kernel/kprobes/opt.c, ``can_optimize``).
"""

from __future__ import annotations

from collections.abc import Iterable

from ksim.errors import (
    Blacklisted,
    BugSite,
    ExtableSite,
    FtraceSite,
    JumpLabelSite,
    OutsideText,
    ProbedSite,
    SpliceError,
    StaticCallSite,
    UnsafeSite,
)

#: hazard name -> (error class, what it means); the names are the wire names too
HAZARDS: dict[str, tuple[type[SpliceError], str]] = {
    "blacklist": (Blacklisted, "code that must never be instrumented "
                               "(trap or entry path, noinstr text, kprobes blacklist)"),
    "not_text": (OutsideText, "not kernel or module text"),
    "kprobe": (ProbedSite, "the kernel's own kprobe is there (the text is not the original)"),
    "breakpoint": (ProbedSite, "an int3 that is not ksim's: another instrumenter's breakpoint"),
    "ftrace": (FtraceSite, "an ftrace location (__mcount_loc): the kernel rewrites it "
                           "when tracing starts"),
    "jump_label": (JumpLabelSite, "a jump-label site (__jump_table): the kernel rewrites it "
                                  "when its static key flips"),
    "static_call": (StaticCallSite, "a static-call site or trampoline: the kernel rewrites it "
                                    "when the static call is updated"),
    "warn": (BugSite, "a WARN site (__bug_table): the kernel finds its trap instruction by "
                      "address"),
    "bug": (BugSite, "a BUG site (__bug_table): the kernel finds its trap instruction by "
                     "address"),
    "extable": (ExtableSite, "an instruction with an exception-table fix-up (__ex_table), "
                             "found by address when it faults"),
    "exclusive": (UnsafeSite, "between a load-exclusive and its store-exclusive: code run "
                              "there may clear the exclusive monitor and the store then "
                              "fails on every retry (kprobes refuses it too)"),
    "branch_prot": (UnsafeSite, "a BTI landing pad or a pointer-authentication check "
                                "(autiasp, retaa): kprobes refuses to step it"),
    "unknown": (UnsafeSite, "the kernel could not tell whether this text may be touched"),
}
#: most specific first: the error raised for an instruction with several hazards
_ORDER = tuple(HAZARDS)


def describe(names: Iterable[str]) -> str:
    """What the hazards mean, most specific first."""
    found = sorted(set(names), key=_rank)
    return "; ".join(HAZARDS[n][1] if n in HAZARDS else n for n in found)


def error_class(names: Iterable[str]) -> type[SpliceError]:
    """The error class of the most specific of the hazards ``names``."""
    found = sorted(set(names), key=_rank)
    return HAZARDS[found[0]][0] if found and found[0] in HAZARDS else UnsafeSite


def error_for(address: int, names: Iterable[str], *, what: str = "") -> SpliceError:
    """The specific refusal for an instruction at ``address`` with hazards ``names``."""
    names = set(names)
    where = f"{address:#x}" + (f" ({what})" if what else "")
    return error_class(names)(f"{where} is {describe(names)}: ksim never overwrites or moves it")


def _rank(name: str) -> int:
    return _ORDER.index(name) if name in _ORDER else len(_ORDER)
