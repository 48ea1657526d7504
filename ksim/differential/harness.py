"""Differential execution of real kernel code: original versus spliced.

A *case* is (image, function, point, tactic, snippet, seed).  The planner is asked
for the case's patch exactly as the Manager asks it (``SiteFacts`` gives the
function's code, its live registers, padding slots and the blacklist); then the
function runs twice in unicorn from the point with the same seeded machine state,
once on the original text and once on the spliced text with the patch in place,
and the two runs are compared.  A refusal of the planner is an answer too (its
error class and message are kept).

What differs between architectures is theirs (``Arch.emulation``, with its
``DifferentialRules``): unicorn's registers, the status flags and the bits the
ABI keeps clear, the per-cpu base, the breakpoint's interrupt, the BUG
instruction, which instructions end a run, and where a call leaves its return
address.  x86-64 and AArch64 declare them; the examples below are x86-64's,
with AArch64's differences in brackets.  An architecture that declares none is
refused by a Harness.

The machine
-----------
* Kernel addresses need unicorn's virtual TLB (``UC_TLB_VIRTUAL`` and a
  ``UC_HOOK_TLB_FILL`` hook): every page is mapped when first touched.  Image
  pages hold the image's sections (text, rodata, data; relocatable modules at
  their synthetic layout, relocations not applied), over a filler derived from
  (seed, page address); any other kernel-half page holds that filler only.  The
  filler is a mix of zeros, small integers, pointers into a small heap window and
  random words, so that pointer chasing goes on for a while.  Both runs see the
  same bytes at the same addresses, whatever order they touch them in.
* Accesses to the user half, to non-canonical addresses or beyond a page budget
  fault (the kernel would oops: SMAP, #GP, or simply a wild pointer).  Text is
  execute-only (code does not read its own instructions; an unrelocated module's
  rip-relative operands would otherwise read the splice's bytes), read-only
  sections are not writable.  A fetch anywhere reaches the per-instruction hook,
  which decides what leaving the function means.
* The run starts at the point with seeded general-purpose registers and status
  flags (DF clear, as the kernel's ABI keeps it), the stack pointer inside a
  mapped stack, and a per-cpu base (GS base) [TPIDR_EL1 holds the offset that
  carries the image's per-cpu variables into the direct map; SP_EL0, current,
  a task in the heap window; the link register x30 a user address, so that
  returning from the function is leaving it].  The patch area lies just past the image's last
  section (within rel32 reach of its text), with the counter variable on its own
  page after the code.
* Calls are stepped over: when control reaches an address outside the function
  (and outside the patch) while the top of the stack [the link register] holds
  the return address of one of the function's call instructions, the callee and
  its argument registers are recorded, the return address popped [left in the
  link register, as the callee's RET leaves it], and RAX, the other
  caller-saved registers and the status flags set to values derived from (seed,
  callee, number of calls so far).  Any other departure ends the run: a return
  past the starting frame, a jump out of the function, a fault, an instruction
  whose effect is not deterministic or not the function's own business (rdtsc,
  rdrand, port I/O, MSRs, control registers, hlt, ... [ERET, SVC/HVC/SMC, WFI,
  TLB maintenance, the counters, writes to system registers but DAIF and
  NZCV, UDF]), a breakpoint that is not
  the splice's own trap (``trap``), and control reaching the alignment filler after the
  function's code or the middle of a splice's window (the planner relies on
  neither happening; a springboard slot counts as the splice's only when the
  point's own short jump goes there).
* The BUG instruction (``ud2`` [``BRK #0x800``]) is handled as Linux's ``handle_bug`` does: at an
  address the image's ``__bug_table`` lists as a WARN the run goes on after it
  (the warning is recorded), elsewhere it ends the run (``bug``, or ``bug-insn``
  where the table lists no BUG).  A fault at an
  address ``__ex_table`` lists ends the run as ``fault-fixup``: the kernel would
  recover there, and only there.  These are looked up by the address the CPU
  reports, so an instruction moved into a patch loses its entry, as it would in
  the kernel.
* The trap tactic's trap is dispatched as the kernel's int3 [BRK] handler does: the
  interrupted code continues at the patch with its registers and stack.

Budgets
-------
Both runs stop before the instruction at which ``budget`` instructions at
original-text addresses the patch does not overwrite have run, so they stop at
the same original instruction.  Two more limits keep loops that never touch such
addresses finite and comparable: the point may be reached (original) or the
patch entered (spliced) ``budget`` times, and at most ``20 * budget`` original
instructions may run, counting a displaced instruction's copy in the patch as
the instruction itself (an iteration of a rep-prefixed instruction counts as one
instruction; the point is reached once per execution, not per iteration).

The comparison
--------------
* the exit, kind and address (an exit inside a displaced instruction's copy, or
  on entering the patch, is reported at the original instruction);
* every general-purpose register and the status flags, except registers (and
  flags) dead at the point that the original run did not write again after it
  last reached the point: the snippet may clobber those.  The flags are left out
  when a run ended in a fault: unicorn then rebuilds them from lazily kept state
  that depends on where its translation blocks began, which a splice changes;
* the ordered list of memory writes (address, size, value): the spliced run may
  add writes only to the counter and to stack bytes below the stack pointer
  (kernel code has no red zone: a write into the stack's pages below the stack
  pointer is dead and not compared, unless a push [a store pre-indexed below sp
  with writeback] made it), and the final bytes of everything the original run
  wrote must be the same;
* the stepped-over calls with their arguments, and the WARNs passed;
* how often the patch ran against how often the point was reached, and the
  counter against that number (zero for the empty snippet).
"""

from __future__ import annotations

import bisect
import hashlib
import random
import struct
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import capstone
import unicorn

from ksim.analysis.points import Point, PointKind, is_padding
from ksim.arch.base import Arch, DifferentialRules, Emulation, Flow, Insn
from ksim.core import KernelABI, MemRef
from ksim.errors import EmulationError, KsimError, NoSafeTactic
from ksim.image.image import Image
from ksim.image.model import Function
from ksim.image.tables import TextRef
from ksim.machine.boards import TCG_BUFFER
from ksim.snippets import ast
from ksim.splice import planner
from ksim.splice.patch import Patch
from ksim.splice.sites import SiteFacts

#: what a case may ask for
TACTICS = ("jmp", "jmp+displace", "springboard", "trap")
SNIPPETS = ("empty", "counter")
#: "tricky": an instruction splicing gets wrong most easily (see random_cases)
KINDS = ("entry", "block", "callsite", "insn", "tricky")

#: result statuses
EQUIVALENT = "equivalent"
REFUSED = "refused"
DIFFERENT = "not-equivalent"

DEFAULT_BUDGET = 300
#: original instructions (budgeted or not) a run may execute, per budgeted one
STEP_FACTOR = 20

PAGE = 0x1000
_MASK64 = (1 << 64) - 1
_KERNEL_HALF = 0xFFFF_8000_0000_0000
#: where the filler's pointers point: a 1 MB window of the direct map
HEAP = 0xFFFF_8881_0000_0000
HEAP_PAGES = 256
#: the stack: STACK_PAGES pages outside the page budget, the run starts in the middle
STACK = 0xFFFF_C900_0040_0000
STACK_PAGES = 8
#: how far below the stack pointer a write may be the snippets' own
FRAME_LIMIT = PAGE
#: this CPU's per-cpu base (inside the heap window)
PERCPU_BASE = 0xFFFF_8881_3FC0_0000
#: the current task, where an architecture keeps it in a register (inside the
#: heap window; where it is per-cpu data, the filler says)
CURRENT_TASK = HEAP + HEAP_PAGES * PAGE // 2
#: the return address a run starts with where calls leave it in a link register:
#: a user address, never text, where returning from the function is leaving it
RETURN_ADDRESS = 0x0000_7E7E_0000_0000
#: emu_start's end address: non-canonical, never reached by the code (its page,
#: or on AArch64 the page below it, is asked for by unicorn itself when it
#: stops, and refused quietly)
_UNTIL = 0x5A5A_5A5A_5A5A_5000
#: pages a run may map beyond the image's stack, patch and counter pages
LAZY_PAGES = 256
#: the patch area: code, then one data page holding the counter
AREA_SIZE = 0x10000
AREA_DATA = 0xC000
TIMEOUT_S = 60.0

_R, _W, _X = unicorn.UC_PROT_READ, unicorn.UC_PROT_WRITE, unicorn.UC_PROT_EXEC
_NEED = {unicorn.UC_MEM_READ: _R, unicorn.UC_MEM_WRITE: _W, unicorn.UC_MEM_FETCH: _X}
_ACCESS = {unicorn.UC_MEM_READ: "read", unicorn.UC_MEM_WRITE: "write",
           unicorn.UC_MEM_FETCH: "fetch"}

#: exits raised inside an instruction
_FAULTS = frozenset({"fault", "fault-fixup", "exception", "error"})
#: exits whose detail is the instruction's text
_TEXT_EXITS = frozenset({"insn", "invalid"})


# --- plain data ---------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    """One question: splice ``address`` of ``function`` by ``tactic`` (one of
    TACTICS, exactly that one; or a policy such as "auto") with ``snippet``
    ("empty" or "counter"), then run both texts from the state ``seed`` makes."""

    function: str
    address: int
    tactic: str
    snippet: str
    seed: int
    #: how the point was chosen ("entry", "block", "callsite", "insn"); informational
    kind: str = "insn"

    def __str__(self) -> str:
        return (f"{self.function}@{self.address:#x} [{self.tactic}, {self.snippet}, "
                f"seed {self.seed}]")


@dataclass(frozen=True)
class Exit:
    """How a run ended: ``kind`` at ``address`` (see the module docstring)."""

    kind: str
    address: int
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.kind} at {self.address:#x}" + (f" ({self.detail})" if self.detail else "")


@dataclass(frozen=True)
class MemWrite:
    address: int
    size: int
    value: int

    def __str__(self) -> str:
        return f"[{self.address:#x}]:{self.size} = {self.value:#x}"


@dataclass(frozen=True)
class Call:
    """A stepped-over call: where control went, with rdi, rsi, rdx, rcx, r8, r9."""

    callee: int
    args: tuple[int, ...]

    def __str__(self) -> str:
        return f"{self.callee:#x}({', '.join(f'{a:#x}' for a in self.args)})"


@dataclass
class Run:
    """What one execution did."""

    exit: Exit
    regs: dict[str, int]
    flags: int
    writes: list[MemWrite]
    #: per write (spliced run): whether it may be the snippet's own (counter, dead stack)
    extra_ok: list[bool]
    calls: list[Call]
    #: original: times the point was reached; spliced: times the patch was entered
    hits: int
    #: budgeted instructions run (original text the patch does not overwrite)
    executed: int
    #: original instructions run, displaced ones included
    steps: int
    warnings: list[int]
    counter: int
    #: final value of each byte the original run wrote
    final: dict[int, int]
    #: original run: registers (and "flags") dead at the point that were not
    #: written after it was last reached: the snippet may have left them changed;
    #: and the flags when the last instruction to set them left them undefined
    unsettled: frozenset[str] = frozenset()
    #: per write (spliced run): whether the snippets' code made it (never one of
    #: the original's, even where it writes the same bytes as the original's next)
    own: list[bool] = field(default_factory=list)


@dataclass(frozen=True)
class Planned:
    """A case's plan, with what the harness needs to know about its layout."""

    point: Point
    function: Function
    code: planner.FunctionCode
    live: frozenset[str]
    patch: Patch
    #: the snippets' code, at the start of the patch
    body: bytes
    #: the original instructions the patch carries (the point's first)
    moved: tuple[Insn, ...]
    #: where each moved instruction's copy starts in the patch: copy -> original
    copies: dict[int, int]


@dataclass(frozen=True)
class Result:
    case: Case
    status: str
    #: the point as function+offset
    where: str
    #: the tactic the patch used (None when refused)
    tactic: str | None = None
    #: a refusal: "ErrorClass: message"
    reason: str = ""
    #: what differs (not-equivalent), most telling first
    diffs: tuple[str, ...] = ()
    #: budgeted instructions the original run executed, times it reached the point
    executed: int = 0
    hits: int = 0
    exit: Exit | None = None
    #: the moved instructions, as text and bytes
    moved: str = ""
    patch: Patch | None = field(default=None, repr=False)

    @property
    def equivalent(self) -> bool:
        return self.status == EQUIVALENT

    @property
    def refused(self) -> bool:
        return self.status == REFUSED

    @property
    def refusal(self) -> str:
        """The refusal's error class name ('' when not refused)."""
        return self.reason.split(":", 1)[0] if self.refused else ""

    def describe(self) -> str:
        head = f"{self.where} [{self.case.tactic}, {self.case.snippet}, seed {self.case.seed}]"
        if self.refused:
            return f"{head}: refused: {self.reason}"
        if self.equivalent:
            return f"{head}: equivalent ({self.tactic}; {self.executed} insns, {self.exit})"
        lines = [f"{head}: NOT equivalent ({self.tactic}; moved {self.moved})"]
        lines += [f"    {d}" for d in self.diffs]
        return "\n".join(lines)


# --- seeded values --------------------------------------------------------------------
def _key(*parts: object) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=16).digest(), "little")


def _value(rng: random.Random, pointers: float = 0.4) -> int:
    """A register or memory word: a heap pointer (share ``pointers``), else zero,
    a small integer, a small negative one, or anything."""
    r = rng.random()
    if r < pointers:
        return HEAP + rng.randrange(HEAP_PAGES) * PAGE + 8 * rng.randrange(PAGE // 8)
    r = (r - pointers) / (1 - pointers)
    if r < 0.3:
        return 0
    if r < 0.7:
        return rng.randrange(256)
    if r < 0.8:
        return -rng.randrange(1, 256) & _MASK64
    return rng.getrandbits(64)


def _filler(seed: int, page: int) -> bytes:
    rng = random.Random(_key(seed, "page", page))
    return struct.pack("<512Q", *(_value(rng) for _ in range(PAGE // 8)))


def _mask(size: int) -> int:
    return (1 << (8 * min(size, 8))) - 1


def _random_status(cpu: Emulation, rng: random.Random) -> int:
    """Seeded status flags, less those the kernel's ABI keeps clear."""
    bits = rng.getrandbits(max(16, cpu.status_mask.bit_length()))
    return bits & cpu.status_mask & ~cpu.status_clear_mask


def _base(mnemonic: str) -> str:
    """The operation without its prefixes ("notrack call" -> "call")."""
    return mnemonic.rsplit(" ", 1)[-1]


def _text(insn: Insn) -> str:
    return f"{insn.mnemonic} {insn.op_str}".strip()


def _decode(cs: capstone.Cs, raw: bytes, address: int) -> Insn:
    """The first instruction of ``raw``, as text and bytes only (the hooks need
    no more, and capstone's lite mode is the cheapest way to it)."""
    for _addr, size, mnemonic, op_str in cs.disasm_lite(raw, address, 1):
        return Insn(address, size, raw[:size], mnemonic, op_str)
    return Insn(address, 0, b"", "(bad)", "")


# --- the harness -----------------------------------------------------------------------
class Harness:
    """Differential runs of one image's code (build it once per image: it caches
    the analysis and the image's pages)."""

    def __init__(self, image: Image, arch: Arch | None = None, *, budget: int = DEFAULT_BUDGET,
                 facts: SiteFacts | None = None) -> None:
        if arch is None:
            from ksim.arch import get_arch

            arch = get_arch(image.arch)
        cpu = arch.emulation
        if cpu.differential is None:
            raise KsimError(f"{arch.name}: the architecture declares no rules for differential "
                            "runs (Emulation.differential)")
        self.image = image
        self.arch = arch
        #: the CPU as unicorn runs it, and what a faithful run treats apart
        self.cpu: Emulation = cpu
        self.rules: DifferentialRules = cpu.differential
        #: the registers a run seeds and compares, and those a stepped-over callee
        #: leaves behind (the convention's caller-saved ones)
        self.gprs = cpu.gprs
        rules = self.rules
        self.clobbered = tuple(r for r in cpu.gprs if r in arch.convention.caller_saved
                               and r != rules.link_reg)
        #: the status flags' name in instructions' register effects and liveness
        self.flags = arch.flags_reg
        self.facts = facts if facts is not None else SiteFacts(image, arch)
        self.budget = budget
        kernel = sorted((s for s in image.sections if s.address >= _KERNEL_HALF and s.size),
                        key=lambda s: s.address)
        if not kernel:
            raise KsimError(f"{image.module}: no sections at kernel addresses to run")
        self._sections = kernel
        top = max(s.end for s in kernel)
        #: the patch area: one empty region past the image's last section
        self.area = (top + 2 * AREA_SIZE - 1) & -AREA_SIZE
        self.counter = self.area + AREA_DATA
        lo = min(start for start, _end in image.text_regions)
        if not (arch.jmp_reaches(lo, self.area) and arch.jmp_reaches(top, self.area + AREA_SIZE)):
            raise KsimError(f"{image.module}: no patch area within jmp reach of its text")
        tables = image.tables
        self.warn_sites = frozenset(tables.addresses(TextRef.WARN))
        self.bug_sites = frozenset(tables.addresses(TextRef.BUG))
        self.extable_sites = frozenset(tables.addresses(TextRef.EXTABLE))
        #: every address the kernel finds or rewrites by itself
        self.table_sites = frozenset(a for ref in TextRef for a in tables.addresses(ref))
        self.abi = _abi(image, self.counter)
        #: what the per-cpu register holds: this CPU's base, or (an offset added to
        #: per-cpu variables' link-time addresses) the offset that carries the
        #: image's per-cpu section there
        self.percpu_value = PERCPU_BASE
        if rules.percpu_offset:
            start = (image.address_of("__per_cpu_start") if _has_symbol(image, "__per_cpu_start")
                     else kernel[0].address)
            self.percpu_value = (PERCPU_BASE - start) & _MASK64
        self.cs = capstone.Cs(cpu.cs_arch, cpu.cs_mode)
        #: what fills the patch area around the code, and pages code may only jump
        #: to: the architecture's padding, which traps if it is ever executed
        self.filler_page = bytes([arch.pad_byte]) * PAGE
        self._pages: dict[int, tuple[int, tuple[tuple[int, bytes], ...]]] = {}

    # --- names ---------------------------------------------------------------------
    def where(self, address: int) -> str:
        func = self.image.function_at(address)
        return f"{func.name}+{address - func.address:#x}" if func else f"{address:#x}"

    def snippet(self, name: str) -> ast.Snippet:
        if name == "empty":
            return ast.Seq(())
        if name == "counter":
            v = ast.Var(self.counter, 8)
            return v.atomic_assign(v + 1)
        raise KsimError(f"unknown snippet {name!r}; use one of {', '.join(SNIPPETS)}")

    # --- planning ------------------------------------------------------------------
    def plan(self, case: Case, *,
             compile_hook: Callable[[bytes, int], bytes] | None = None,
             code_hook: Callable[[planner.FunctionCode], planner.FunctionCode] | None = None,
             ) -> Planned:
        """The case's patch, asked of the planner with the Manager's inputs.

        ``compile_hook(code, address)`` may change the snippets' machine code and
        ``code_hook`` the planner's view of the function (tests build wrong patches
        with them).  Raises the planner's KsimError when it refuses."""
        point = self.facts.point_at(case.address)
        func = self.facts.function_of(point)
        code = self.facts.function_code(point)
        if code_hook is not None:
            code = code_hook(code)
        live = self.facts.live_at(point)
        snippets = [self.snippet(case.snippet)]
        arch, abi = self.arch, self.abi

        def compile_at(address: int) -> bytes:
            out = arch.compile_snippets(snippets, address, live=live, abi=abi,
                                        point_kind=str(point.kind.value))
            return compile_hook(out, address) if compile_hook is not None else out

        req = self.facts.request(point.address, code, compile_at, self.area, policy=case.tactic)
        planner.check_point(arch, req)
        bound = planner.patch_size_bound(arch, req)
        tactic = planner.TACTICS.get(case.tactic)
        if tactic is None:  # a policy ("auto"): the planner picks
            patch = planner.plan(arch, req)
        else:  # exactly this tactic ("jmp" alone is also the name of a policy)
            made = tactic(arch, req)
            if isinstance(made, str):
                raise NoSafeTactic(point.address, {case.tactic: made})
            patch = made
        if len(patch.code) > bound:
            raise KsimError(f"patch code ({len(patch.code)} bytes) outgrew its bound ({bound})")
        if len(patch.code) > AREA_DATA:
            raise KsimError(f"patch code ({len(patch.code)} bytes) exceeds the harness's area")
        body = compile_at(self.area)
        head = next((w for w in patch.writes if w.address == patch.point), None)
        end = head.end if head is not None else point.address + 1
        moved = tuple(i for i in code.insns if point.address <= i.address < end)
        return Planned(point, func, code, live, patch, body, moved,
                       _copies(arch, moved, self.area + len(body)))

    # --- running -------------------------------------------------------------------
    def run_case(self, case: Case, *,
                 compile_hook: Callable[[bytes, int], bytes] | None = None,
                 code_hook: Callable[[planner.FunctionCode], planner.FunctionCode] | None = None,
                 transform: Callable[[Planned], Patch] | None = None) -> Result:
        """Plan the case, run it twice and compare.  ``transform`` may replace the
        planned patch (tests build wrong patches with it)."""
        where = self.where(case.address)
        try:
            planned = self.plan(case, compile_hook=compile_hook, code_hook=code_hook)
        except KsimError as exc:
            return Result(case, REFUSED, where, reason=f"{type(exc).__name__}: {exc}")
        patch = transform(planned) if transform is not None else planned.patch
        ctx = _Context(self, case, planned, patch)
        original, spliced = _both(ctx)
        diffs = ctx.check_writes() + _compare(ctx, original, spliced)
        moved = "; ".join(f"{i.mnemonic} {i.op_str}".strip() + f" ({i.raw.hex()})"
                          for i in planned.moved)
        return Result(case, EQUIVALENT if not diffs else DIFFERENT, where, tactic=patch.tactic,
                      diffs=tuple(diffs), executed=original.executed, hits=original.hits,
                      exit=original.exit, moved=moved, patch=patch)

    def runs(self, case: Case, *,
             compile_hook: Callable[[bytes, int], bytes] | None = None,
             code_hook: Callable[[planner.FunctionCode], planner.FunctionCode] | None = None,
             transform: Callable[[Planned], Patch] | None = None) -> tuple[Run, Run]:
        """Both runs of a case, original and spliced, for a closer look (the options
        are run_case's).  Raises the planner's KsimError when it refuses."""
        planned = self.plan(case, compile_hook=compile_hook, code_hook=code_hook)
        patch = transform(planned) if transform is not None else planned.patch
        return _both(_Context(self, case, planned, patch))

    # --- the image's pages ----------------------------------------------------------
    def image_page(self, page: int) -> tuple[int, tuple[tuple[int, bytes], ...]]:
        """(permissions, (offset, bytes) of each section in it) for one page."""
        hit = self._pages.get(page)
        if hit is not None:
            return hit
        segments = []
        executable = read_only = False
        for s in self._sections:
            if s.address >= page + PAGE:
                break
            if s.end <= page:
                continue
            lo, hi = max(page, s.address), min(page + PAGE, s.end)
            data = s.data[lo - s.address:hi - s.address] if s.data else b""
            segments.append((lo - page, data + bytes(hi - lo - len(data))))
            executable |= s.executable
            read_only |= not s.writable
        # Text is execute-only: kernel code does not read its own instructions, and
        # a module whose relocations are not applied would read them through every
        # rip-relative operand (disp32 0 points at the next instruction), seeing
        # the splice's bytes; both runs fault there instead.  Read-only data is not
        # writable.  Everything may be fetched, so that the per-instruction hook
        # sees every departure from the function.
        perms = _X if executable else _R | _X if read_only else _R | _W | _X
        hit = (perms, tuple(segments))
        self._pages[page] = hit
        return hit


def run_case(harness: Harness, case: Case, **options: Any) -> Result:
    """``harness.run_case(case, **options)``."""
    return harness.run_case(case, **options)


def random_cases(harness: Harness, count: int, seed: int = 0, *,
                 functions: Sequence[Function] | None = None,
                 tactics: Sequence[str] = TACTICS, snippets: Sequence[str] = SNIPPETS,
                 kinds: Sequence[str] = KINDS) -> Iterator[Case]:
    """``count`` seeded random cases over the image: a function SiteFacts can
    analyse (outside the blacklist), a point of a random kind in it (its entry, a
    block start, a call site, any instruction, or a tricky one), a tactic, a
    snippet, a seed.

    Tricky points are those a splice gets wrong most easily: instructions with a
    RIP-relative operand, calls (direct and indirect), prefixed instructions (rep,
    lock, segment, operand or address size), loop heads whose backward branch lies
    within a jump's length, and points whose jump-sized window would reach an
    address the kernel keeps in one of its tables (WARN/BUG, exception table,
    ftrace, jump labels, static calls)."""
    rng = random.Random(_key("cases", seed))
    facts = harness.facts
    pool = list(functions) if functions is not None else list(harness.image.functions)
    bad: set[int] = set()
    made = attempts = 0
    while made < count:
        attempts += 1
        if attempts > 50 * count + 1000:
            raise KsimError(f"{harness.image.module}: too few analysable functions for {count} cases")
        func = rng.choice(pool)
        if func.address in bad:
            continue
        try:
            if any(lo <= func.address < hi for lo, hi in facts.blacklist):
                raise KsimError("blacklisted")
            kind = rng.choice(kinds)
            if kind == "entry":
                addresses = [facts.entry(func).address]
            elif kind == "block":
                addresses = [p.address for p in facts.points(func, PointKind.BLOCK)]
            elif kind == "callsite":
                addresses = [p.address for p in facts.points(func, PointKind.CALLSITE)]
            else:
                addresses = [i.address for b in facts.analysis(func).blocks
                             if not is_padding(b, harness.arch) for i in b.insns]
                if kind == "tricky":
                    addresses = _tricky(harness, facts.function_code(func).insns) or addresses
        except KsimError:
            bad.add(func.address)
            continue
        if not addresses:
            continue
        yield Case(func.name, rng.choice(addresses), rng.choice(tactics), rng.choice(snippets),
                   rng.getrandbits(32), kind)
        made += 1


def _tricky(harness: Harness, insns: Sequence[Insn]) -> list[int]:
    """The tricky points among ``insns`` (see random_cases)."""
    reach = harness.arch.jmp_size
    sites = harness.table_sites
    prefixes = harness.rules.prefix_bytes
    out = set()
    for insn in insns:
        if (insn.pc_ref is not None or insn.flow in (Flow.CALL, Flow.CALL_INDIRECT)
                or (insn.raw and insn.raw[0] in prefixes)):
            out.add(insn.address)
        if (insn.flow is Flow.JCC and insn.target is not None
                and 0 <= insn.address - insn.target < reach):
            out.add(insn.target)
        if any(a in sites for a in range(insn.address + 1, insn.address + reach)):
            out.add(insn.address)
    starts = {i.address for i in insns}
    return sorted(out & starts)


def tally(results: Iterable[Result]) -> dict[str, Any]:
    """Counts: equivalent, refused (by error class), not equivalent (by tactic)."""
    out: dict[str, Any] = {EQUIVALENT: 0, REFUSED: Counter(), DIFFERENT: Counter(), "executed": 0}
    for r in results:
        if r.equivalent:
            out[EQUIVALENT] += 1
            out["executed"] += r.executed
        elif r.refused:
            out[REFUSED][r.refusal] += 1
        else:
            out[DIFFERENT][r.tactic or "?"] += 1
    return out


# --- internals ---------------------------------------------------------------------------
def _abi(image: Image, data: int) -> KernelABI:
    """Linux's per-cpu current_task and cpu_number when the image names them (their
    per-cpu offsets), else plain variables beside the counter.  The pid offset is
    only illustrative: no snippet here reads it."""
    if _has_symbol(image, "current_task"):
        current = MemRef(image.address_of("current_task"), "gs", 8)
        cpu = (MemRef(image.address_of("cpu_number"), "gs", 4)
               if _has_symbol(image, "cpu_number") else None)
    else:
        current, cpu = MemRef(data + 8, None, 8), MemRef(data + 16, None, 4)
    return KernelABI(current_task=current, task_pid_offset=0x5A0, task_pid_size=4,
                     cpu_number=cpu)


def _has_symbol(image: Image, name: str) -> bool:
    try:
        image.symbol(name)
    except KsimError:
        return False
    return True


def _copies(arch: Arch, moved: Sequence[Insn], at: int) -> dict[int, int]:
    """copy address -> original address of each moved instruction, as laid out by
    the relocator after the snippets (a moved call comes after the others)."""
    out: dict[int, int] = {}
    for k, insn in enumerate(moved):
        try:
            offset = len(arch.relocate(moved[:k], at)) if k else 0
        except KsimError:
            break
        out[at + offset] = insn.address
    return out


class _Context:
    """What both runs of a case share."""

    def __init__(self, harness: Harness, case: Case, planned: Planned, patch: Patch) -> None:
        self.h = harness
        self.case = case
        self.planned = planned
        self.patch = patch
        self.point = planned.point.address
        self.func = planned.function
        self.live = planned.live
        self.overwritten = frozenset(a for w in patch.writes + patch.extra
                                     for a in range(w.address, w.end))
        #: springboard slots: written, entered only from the point's short jump
        self.boards = frozenset(w.address for w in patch.writes + patch.extra
                                if w.address != patch.point)
        self.code_end = planned.code.end
        self.code_lo = patch.code_address
        self.code_hi = patch.code_address + len(patch.code)
        self.body_hi = patch.code_address + len(planned.body)
        self.copies = planned.copies
        self.copy_starts = sorted(planned.copies)
        insns = harness.facts.analysis(self.func).insns
        self.insns = {i.address: i for i in insns}
        self.returns = frozenset(i.end for i in insns if i.flow in (Flow.CALL, Flow.CALL_INDIRECT))
        #: what the snippets may clobber: registers (and flags) dead at the point
        self.dead = (frozenset(harness.gprs) | {harness.flags}) - self.live
        self.budget = harness.budget
        self.step_limit = STEP_FACTOR * harness.budget

    def where_is(self, address: int, spliced: bool, previous: int) -> str:
        """What control at ``address`` means: "code" (the function's instructions),
        "patch" (the patch, or the springboard slot reached by the point's own short
        jump), "window" (bytes a splice overwrote, reached by anything else),
        "filler" (the never-executed filler after the function's code, inside its
        extent), or "outside"."""
        if self.func.address <= address < self.code_end:
            if spliced and address in self.overwritten and address != self.point:
                return "window"
            return "code"
        if spliced and (self.code_lo <= address < self.code_hi
                        or (address in self.boards and previous == self.point)):
            return "patch"
        if self.func.address <= address < self.func.end:
            return "filler"
        return "outside"

    def countable(self, address: int) -> bool:
        return self.func.address <= address < self.code_end and address not in self.overwritten

    def original_of(self, address: int, spliced: bool) -> int | None:
        """The original instruction running at ``address`` (None: the splice's own code)."""
        if not spliced:
            return address
        if self.countable(address):
            return address
        return self.copies.get(address)

    def map_exit(self, exit: Exit) -> Exit:
        """An exit of the spliced run, at the original instruction when it happened in
        a moved instruction's copy (any instruction the relocator made of it), or on
        entering the patch."""
        if exit.address == self.patch.code_address and exit.kind == "budget":
            return Exit(exit.kind, self.point, exit.detail)
        k = bisect.bisect_right(self.copy_starts, exit.address) - 1
        if k < 0 or not exit.address < self.code_hi:
            return exit
        original = self.copies[self.copy_starts[k]]
        detail = exit.detail
        insn = self.insns.get(original)
        if exit.kind in _TEXT_EXITS and insn is not None:
            # the original instruction's text, not its relocated copy's
            detail = _text(_decode(self.h.cs, insn.raw, original))
        return Exit(exit.kind, original, detail)

    def check_writes(self) -> list[str]:
        """The patch's writes must replace the original text (a stale plan would not poke)."""
        out = []
        for w in self.patch.writes + self.patch.extra:
            try:
                now = self.h.image.read(w.address, len(w.old))
            except KsimError:
                continue
            if now != w.old:
                out.append(f"patch write at {w.address:#x} expects {w.old.hex()}, "
                           f"the text holds {now.hex()}")
        return out


class _Machine:
    """One run of a case: original (``spliced=False``) or spliced text."""

    def __init__(self, ctx: _Context, *, spliced: bool, snapshot: Iterable[int] = ()) -> None:
        self.ctx = ctx
        self.h = ctx.h
        self.seed = ctx.case.seed
        self.spliced = spliced
        self.snapshot = tuple(snapshot)
        self.cpu = cpu = ctx.h.cpu
        self.rules = ctx.h.rules
        self.uc = unicorn.Uc(cpu.uc_arch, cpu.uc_mode)
        # a case runs one function's paths: its translations fit a small buffer, and a
        # machine's resident size stays that small (unicorn's default is 1 GiB)
        self.uc.ctl_set_tcg_buffer_size(TCG_BUFFER)  # type: ignore[attr-defined]
        if self.rules.cpu_model is not None:
            self.uc.ctl_set_cpu_model(self.rules.cpu_model)  # type: ignore[attr-defined]
        self.uc.ctl_set_tlb_mode(unicorn.UC_TLB_VIRTUAL)  # type: ignore[attr-defined]
        self.uc_page: int = self.uc.ctl_get_page_size()  # type: ignore[attr-defined]
        self.phys: dict[int, int] = {}  # virtual page -> physical page
        self.virt: dict[int, int] = {}  # physical page -> virtual page
        self.perms: dict[int, int] = {}
        self.next_phys = 0x10_0000
        self.lazy = 0
        self.denied: tuple[int, int] | None = None
        self.exit: Exit | None = None
        self.error: BaseException | None = None
        self.writes: list[MemWrite] = []
        self.extra_ok: list[bool] = []
        self.own: list[bool] = []
        self.calls: list[Call] = []
        self.warnings: list[int] = []
        self.hits = self.executed = self.steps = 0
        self.pc = 0
        self.popped_flags = False
        self.entry_rsp = 0
        self.start_rsp = 0
        self.decoded: dict[int, Insn] = {}
        #: original run: registers dead at the point not written since it was last
        #: reached (their values are the snippet's business), and what the
        #: instruction about to run will write
        self.unsettled: set[str] = set()
        self.pending: frozenset[str] = frozenset()
        #: whether the instruction about to run leaves the status flags undefined
        self.undefines = False
        self.overlay: dict[int, int] = {}
        if spliced:
            for w in ctx.patch.writes + ctx.patch.extra:
                for i, b in enumerate(w.new):
                    self.overlay[w.address + i] = b
        uc = self.uc
        uc.hook_add(unicorn.UC_HOOK_TLB_FILL, self._guard(self._on_tlb_fill))
        uc.hook_add(unicorn.UC_HOOK_CODE, self._guard(self._on_code))
        uc.hook_add(unicorn.UC_HOOK_MEM_WRITE, self._guard(self._on_write))
        uc.hook_add(unicorn.UC_HOOK_INTR, self._guard(self._on_interrupt))

    # --- hooks -----------------------------------------------------------------------
    def _guard(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Keep the first exception a hook raises and stop (re-raised after the run)."""

        def guarded(uc: unicorn.Uc, *args: Any) -> Any:
            try:
                return fn(*args[:-1])
            except BaseException as exc:  # noqa: BLE001 - re-raised by run()
                if self.error is None:
                    self.error = exc
                uc.emu_stop()
                return False

        return guarded

    def _on_tlb_fill(self, vaddr: int, access: int, entry: Any) -> bool:
        page = vaddr & ~(PAGE - 1)
        if page == _UNTIL or page == _UNTIL - PAGE:
            return False
        perms = self.perms.get(page)
        if perms is None:
            perms = self._map(page, access)
        if perms is None or not perms & _NEED.get(access, 0):
            self.denied = (vaddr, access)
            return False
        # unicorn's own pages may be smaller than ours (AArch64: 1 KB)
        entry.paddr = self.phys[page] + (vaddr & (PAGE - 1) & -self.uc_page)
        entry.perms = perms
        return True

    def _on_code(self, address: int, size: int) -> None:
        if self.exit is not None:
            self.uc.emu_stop()
            return
        if self.popped_flags:
            self.popped_flags = False
            status = self._reg(self.cpu.status_reg)
            if status & self.rules.trace_bit:
                # a seeded word popped into the flags set the trap flag: kernel code
                # never single-steps itself, so clear it and translate this
                # instruction again without single-stepping (the hook comes back)
                self._set(self.cpu.status_reg, status & ~self.rules.trace_bit)
                self._set(self.cpu.pc, address)
                return
        self.denied = None
        previous, self.pc = self.pc, address
        ctx = self.ctx
        self.unsettled -= self.pending  # the previous instruction completed
        if self.undefines:
            self.unsettled.add(self.h.flags)
        self.pending, self.undefines = frozenset(), False
        place = ctx.where_is(address, self.spliced, previous)
        if place == "outside":
            self._leave(address)
            return
        if place in ("window", "filler"):
            # the middle of a splice's window, or alignment filler: the planner
            # relies on neither being reached
            self._stop("mid-window" if place == "window" else "filler", address)
            return
        # unicorn calls the hook again for each iteration of a rep-prefixed string
        # instruction: the point is reached once per execution, not per iteration
        repeat = self.rules.repeat_prefix
        again = (address == previous and bool(repeat)
                 and self._insn(address, size).mnemonic.startswith(repeat))
        if address == (ctx.patch.code_address if self.spliced else ctx.point) and not again:
            if self.hits >= ctx.budget:
                self._stop("budget", address, "point")
                return
            self.hits += 1
            if self.spliced:
                self.entry_rsp = self._reg(self.cpu.sp)
            else:
                self.unsettled = set(ctx.dead)
        if not self.spliced:
            insn = ctx.insns.get(address)
            if insn is not None:
                self.pending = insn.writes - insn.reads
                self.undefines = _base(insn.mnemonic) in self.rules.undefined_status
        if ctx.original_of(address, self.spliced) is not None:
            if self.steps >= ctx.step_limit:
                self._stop("limit", address)
                return
            self.steps += 1
        if ctx.countable(address):
            if self.executed >= ctx.budget:
                self._stop("budget", address)
                return
            self.executed += 1
        # unicorn marks an instruction it does not emulate (the BUG instruction
        # among them) by a size beyond the longest: decode it here
        longest = self.cpu.max_insn_size
        insn = self._insn(address, min(size, longest))
        text = _text(insn)
        operation = _base(insn.mnemonic)
        if insn.raw == self.cpu.bug_insn:
            # (before the breakpoints: AArch64's BUG instruction is a BRK)
            if address in self.h.warn_sites:
                # handle_bug -> report_bug: a WARN is reported and skipped
                self.warnings.append(address)
                self._set(self.cpu.pc, address + len(insn.raw))
            else:
                self._stop("bug" if address in self.h.bug_sites else "bug-insn", address)
        elif self.h.arch.is_breakpoint(insn):
            if not (self.spliced and address == ctx.patch.trap_site):
                self._stop("trap", address)
        elif operation in self.rules.status_loads:
            self.popped_flags = True
        elif operation in self.rules.forbidden or self.rules.forbidden_operands.search(insn.op_str):
            self._stop("insn", address, text)
        elif size > longest:
            self._stop("invalid", address, text)

    def _on_write(self, access: int, paddr: int, size: int, value: int) -> None:
        vaddr = self.virt[paddr & ~(PAGE - 1)] | (paddr & (PAGE - 1))
        rsp = self._reg(self.cpu.sp)
        # (the stack's own pages: the heap, and AArch64's image, lie below it too)
        below = STACK <= vaddr and vaddr + size <= rsp
        writer = self.decoded.get(self.pc)
        if below and (writer is None or not self._pushes(writer)):
            # below the stack pointer and not pushed there: dead (kernel code has no
            # red zone), e.g. mb()'s "lock add dword ptr [rsp - 4], 0", which writes
            # back whatever the snippets' own pushes left there
            return
        self.writes.append(MemWrite(vaddr, size, value & _mask(size)))
        if self.spliced:
            counter = self.h.counter
            if counter <= vaddr and vaddr + size <= counter + 8:
                ok = True
            else:
                # the snippets' own code may also use what lay below the stack
                # pointer of the code it interrupted (wherever the seeded state
                # made it point)
                if self.ctx.code_lo <= self.pc < self.ctx.body_hi:
                    rsp = max(rsp, self.entry_rsp)
                ok = rsp - FRAME_LIMIT <= vaddr and vaddr + size <= rsp
            self.extra_ok.append(ok)
            self.own.append(self.ctx.code_lo <= self.pc < self.ctx.body_hi)

    def _pushes(self, insn: Insn) -> bool:
        """Whether ``insn`` writes below the stack pointer and moves it over what it wrote."""
        rules = self.rules
        return _base(insn.mnemonic) in rules.pushing or bool(rules.pushing_operands.search(insn.op_str))

    def _on_interrupt(self, intno: int) -> None:
        cpu = self.cpu
        pc = self._reg(cpu.pc)
        if intno == cpu.breakpoint_vector:
            site = pc - cpu.breakpoint_pc_offset
            if self.spliced and self.ctx.patch.trap_site == site:
                # the kernel's trap handler: resume the interrupted code at its patch
                self._set(cpu.pc, self.ctx.patch.code_address)
                return
            self._stop("trap", site)
        elif intno in cpu.fault_vectors and self.denied is not None:
            self._fault(pc)
        else:
            self._stop("exception", pc, f"vector {intno}")

    # --- decisions ---------------------------------------------------------------------
    def _stop(self, kind: str, address: int, detail: str = "") -> None:
        if self.exit is None:
            self.exit = Exit(kind, address, detail)
        self.uc.emu_stop()

    def _fault(self, rip: int) -> None:
        vaddr, access = self.denied or (0, 0)
        kind = "fault-fixup" if rip in self.h.extable_sites else "fault"
        self._stop(kind, rip, f"{_ACCESS.get(access, 'access')} {vaddr:#x}")

    def _leave(self, address: int) -> None:
        # a call left the return address of one of the function's calls on top of
        # the stack (x86-64) or in the link register (AArch64)
        link = self.rules.link_reg
        rsp = self._reg(self.cpu.sp)
        ret = self.read_u64(rsp) if link is None else self._reg(link)
        # (a link register still holds it once control is there: a call at the
        # end of the code, stepped over, is not called again)
        if ret is not None and ret in self.ctx.returns and (link is None or address != ret):
            self._step_over(address, rsp, ret)
            return
        # past the starting frame, or (a link register) back where the run began
        returned = rsp > self.start_rsp or (link is not None and address == RETURN_ADDRESS)
        self._stop("return" if returned else "jump-out", address)

    def _step_over(self, callee: int, rsp: int, ret: int) -> None:
        h, cpu, link = self.h, self.cpu, self.rules.link_reg
        self.calls.append(Call(callee, tuple(self._reg(r) for r in h.arch.arg_regs)))
        self.unsettled -= {*h.clobbered, h.flags}
        rng = random.Random(_key(self.seed, "call", callee, len(self.calls)))
        for name in h.clobbered:
            self._set(name, _value(rng))
        status = self._reg(cpu.status_reg)
        self._set(cpu.status_reg, (status & ~cpu.status_mask) | _random_status(cpu, rng))
        if link is None:
            self._set(cpu.sp, rsp + self.rules.stack_slot)
        else:
            # the callee returned through the link register, which still holds
            # where it went
            self.unsettled.discard(link)
        self._set(cpu.pc, ret)

    def _insn(self, address: int, size: int) -> Insn:
        hit = self.decoded.get(address)
        if hit is None:
            raw = self.read(address, size)
            hit = (_decode(self.h.cs, raw, address) if raw is not None
                   else Insn(address, 0, b"", "(unmapped)", ""))
            self.decoded[address] = hit
        return hit

    # --- memory --------------------------------------------------------------------------
    def _content(self, page: int, access: int) -> tuple[bytes, int, bool] | None:
        """(bytes, permissions, counts against LAZY_PAGES) of a page, or None: no page."""
        h = self.h
        if h.area <= page < h.area + AREA_DATA:
            data = bytearray(self.h.filler_page)
            if self.spliced:
                code, at = self.ctx.patch.code, self.ctx.patch.code_address
                lo, hi = max(page, at), min(page + PAGE, at + len(code))
                if lo < hi:
                    data[lo - page:hi - page] = code[lo - at:hi - at]
            return bytes(data), _R | _X, False
        if page == h.area + AREA_DATA:
            return bytes(PAGE), _R | _W | _X, False
        if STACK <= page < STACK + STACK_PAGES * PAGE:
            return _filler(self.seed, page), _R | _W | _X, False
        if page < _KERNEL_HALF:
            if access == unicorn.UC_MEM_FETCH:
                # a jump to a user or non-canonical address: fetchable, so that the
                # hook reports it as a departure; any data access there faults
                return self.h.filler_page, _X, True
            return None
        data = bytearray(_filler(self.seed, page))
        perms, segments = h.image_page(page)
        for offset, chunk in segments:
            data[offset:offset + len(chunk)] = chunk
        if self.overlay:
            for a in range(page, page + PAGE):
                b = self.overlay.get(a)
                if b is not None:
                    data[a - page] = b
        return bytes(data), perms, True

    def _map(self, page: int, access: int) -> int | None:
        made = self._content(page, access)
        if made is None:
            return None
        data, perms, counted = made
        if counted:
            if self.lazy >= LAZY_PAGES:
                return None
            self.lazy += 1
        phys = self.next_phys
        self.next_phys += PAGE
        self.uc.mem_map(phys, PAGE, unicorn.UC_PROT_ALL)
        self.uc.mem_write(phys, data)
        self.phys[page], self.virt[phys], self.perms[page] = phys, page, perms
        return perms

    def read(self, address: int, size: int) -> bytes | None:
        """Virtual memory as the code sees it (mapping pages as touching them would)."""
        out = b""
        while size > 0:
            page = address & ~(PAGE - 1)
            if page not in self.phys and self._map(page, unicorn.UC_MEM_READ) is None:
                return None
            n = min(size, page + PAGE - address)
            out += bytes(self.uc.mem_read(self.phys[page] + (address - page), n))
            address, size = address + n, size - n
        return out

    def read_u64(self, address: int) -> int | None:
        raw = self.read(address, 8)
        return None if raw is None else int.from_bytes(raw, "little")

    def _reg(self, name: str) -> int:
        return int(self.uc.reg_read(self.cpu.regs[name]))

    def _set(self, name: str, value: int) -> None:
        self.uc.reg_write(self.cpu.regs[name], value)

    # --- the run ---------------------------------------------------------------------------
    def run(self) -> Run:
        uc, cpu = self.uc, self.cpu
        rng = random.Random(_key(self.seed, "registers"))
        for name in self.h.gprs:
            if name != cpu.sp:
                self._set(name, _value(rng, pointers=0.6))
        rules = self.rules
        self.start_rsp = (STACK + STACK_PAGES * PAGE // 2 - 8 * rng.randrange(64)) \
            & -rules.stack_align
        self._set(cpu.sp, self.start_rsp)
        self._set(cpu.status_reg, cpu.status_reset | _random_status(cpu, rng))
        if rules.link_reg is not None:
            # where the function returns to: no text, so that returning is leaving
            self._set(rules.link_reg, RETURN_ADDRESS)
        # every other register starts at zero, as a new unicorn instance has them
        self._set(cpu.percpu_reg, self.h.percpu_value)
        if rules.current_reg is not None:
            self._set(rules.current_reg, CURRENT_TASK)
        started = time.monotonic()
        try:
            uc.emu_start(self.ctx.point, _UNTIL, timeout=int(TIMEOUT_S * 1e6))
        except unicorn.UcError as exc:
            if self.exit is None and self.error is None:
                if self.denied is not None:
                    # a page fault unicorn stopped at without calling the interrupt
                    # hook (AArch64's data and prefetch aborts)
                    self._fault(self._reg(cpu.pc))
                else:
                    self.exit = Exit("error", self._reg(cpu.pc), str(exc))
        if self.error is not None:
            raise self.error
        if self.exit is None:
            rip = self._reg(cpu.pc)
            if self.denied is not None:
                self._fault(rip)
            elif time.monotonic() - started >= TIMEOUT_S:
                raise EmulationError(f"{self.ctx.case}: no end after {TIMEOUT_S:.0f} s "
                                     f"(rip {rip:#x})")
            else:
                self.exit = Exit("stopped", rip)
        assert self.exit is not None
        exit = self.ctx.map_exit(self.exit) if self.spliced else self.exit
        written = self.snapshot or tuple(sorted({w.address + i for w in self.writes
                                                 for i in range(w.size)}))
        final = {}
        for a in written:
            raw = self.read(a, 1)
            final[a] = raw[0] if raw is not None else -1
        counter = self.read_u64(self.h.counter) or 0
        regs = {name: self._reg(name) for name in self.h.gprs}
        return Run(exit, regs, self._reg(cpu.status_reg), self.writes, self.extra_ok,
                   self.calls, self.hits, self.executed, self.steps, self.warnings, counter, final,
                   frozenset(self.unsettled), self.own)


def _both(ctx: _Context) -> tuple[Run, Run]:
    original = _Machine(ctx, spliced=False).run()
    return original, _Machine(ctx, spliced=True, snapshot=original.final.keys()).run()


def _compare(ctx: _Context, o: Run, s: Run) -> list[str]:
    """What the spliced run did differently (empty: equivalent)."""
    h = ctx.h
    mask = h.cpu.status_mask
    out: list[str] = []
    if o.exit != s.exit:
        out.append(f"exit: original {o.exit} ({h.where(o.exit.address)}), "
                   f"spliced {s.exit} ({h.where(s.exit.address)})")
    regs = [f"{name} {o.regs[name]:#x}/{s.regs[name]:#x}" for name in h.gprs
            if name not in o.unsettled and o.regs[name] != s.regs[name]]
    if regs:
        out.append(f"registers (original/spliced): {', '.join(regs)}")
    # After a fault unicorn may rebuild the flags from lazily kept state that
    # depends on where its translation blocks began (which a splice changes):
    # they are compared only when both runs stopped between instructions.
    faulted = {o.exit.kind, s.exit.kind} & _FAULTS
    if not faulted and h.flags not in o.unsettled and (o.flags ^ s.flags) & mask:
        bits = [n for n, b in h.cpu.status_bits.items() if (o.flags ^ s.flags) >> b & 1]
        out.append(f"flags {'/'.join(bits)}: original {o.flags & mask:#x}, "
                   f"spliced {s.flags & mask:#x}")
    out += _compare_writes(o, s)
    for k, (a, b) in enumerate(zip(o.calls, s.calls, strict=False)):
        if a != b:
            out.append(f"call {k + 1}: original {a} ({h.where(a.callee)}), "
                       f"spliced {b} ({h.where(b.callee)})")
            break
    if len(o.calls) != len(s.calls):
        out.append(f"calls: original {len(o.calls)}, spliced {len(s.calls)}")
    if o.warnings != s.warnings:
        out.append(f"WARNs: original {[hex(a) for a in o.warnings]}, "
                   f"spliced {[hex(a) for a in s.warnings]}")
    if s.hits != o.hits:
        out.append(f"the patch ran {s.hits} times, the point was reached {o.hits} times")
    expected = o.hits if ctx.case.snippet == "counter" else 0
    if s.counter != expected:
        out.append(f"counter {s.counter}, expected {expected}")
    return out


def _compare_writes(o: Run, s: Run) -> list[str]:
    """The spliced run's writes must be the original's, in order, plus writes of its
    own to the counter and to dead stack (the snippets' writes are always its own:
    a saved register that happens to equal the original's next write is not it);
    the original's final bytes must be there."""
    out: list[str] = []
    i = 0
    extras: set[int] = set()
    own = s.own or [False] * len(s.writes)
    for k, (w, ok, mine) in enumerate(zip(s.writes, s.extra_ok, own, strict=True)):
        if not mine and i < len(o.writes) and w == o.writes[i]:
            i += 1
        elif ok:
            extras.update(range(w.address, w.address + w.size))
        else:
            expected = f"the original's next was {o.writes[i]}" if i < len(o.writes) \
                else "the original wrote nothing more"
            out.append(f"write {k + 1} of the spliced run {w}: {expected}")
            return out
    if i < len(o.writes):
        missing = o.writes[i]
        instead = [w for w, ok in zip(s.writes, s.extra_ok, strict=True)
                   if ok and w.address == missing.address]
        out.append(f"the spliced run misses {len(o.writes) - i} writes of the original, "
                   f"first {missing}" + (f" (it wrote {instead[-1]})" if instead else ""))
        return out
    for a in sorted(o.final):
        if a not in extras and o.final[a] != s.final.get(a):
            out.append(f"memory at {a:#x}: original {o.final[a]:#04x}, "
                       f"spliced {s.final.get(a, -1):#04x}")
            break
    return out
