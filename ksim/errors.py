"""ksim's error hierarchy: one base class, one subclass per cause.

Every refusal names its cause with its own class so that callers (and the live
daemon, which carries these causes over the wire by class name) can react to a
specific failure.  ``code`` is the stable wire name of each cause.
"""

from __future__ import annotations


class KsimError(Exception):
    """Base of every error ksim raises on purpose."""

    code = "ksim"


# --- images -----------------------------------------------------------------
class ImageError(KsimError):
    """An image (ELF kernel, module, kallsyms file) cannot be used."""

    code = "image"


class MalformedImage(ImageError):
    """The file is not a well-formed ELF (or kallsyms) file: truncated, corrupt, wrong magic."""

    code = "malformed-image"


class UnsupportedImage(ImageError):
    """A well-formed file ksim cannot handle (wrong machine, class or byte order)."""

    code = "unsupported-image"


class ImageBuildError(ImageError):
    """Building a bundled image from source failed."""

    code = "image-build"


class UnknownImage(ImageError):
    code = "unknown-image"


class BadArgument(KsimError, ValueError):
    """An API call given a value of the wrong kind or outside its domain (an address
    that is not an int, a size that is not positive, something that is not a point);
    refused before anything was changed."""

    code = "bad-argument"


class Detached(KsimError):
    """A Manager used after detach(): its target is gone (attach again)."""

    code = "detached"


class PointSyntaxError(BadArgument):
    """A point named in text (``ksim count FUNC``: NAME, NAME+OFFSET, an address or
    a wildcard) that does not follow that grammar: the message says where."""

    code = "point-syntax"


class UsageError(KsimError):
    """A command line that does not follow the command's usage (argparse refused it:
    an unknown option or command, a missing argument, a value of the wrong kind).
    ``usage`` is the command's usage line, ``prog`` the command."""

    code = "usage"

    def __init__(self, prog: str, message: str, usage: str = "") -> None:
        self.prog, self.message, self.usage = prog, message, usage
        super().__init__(f"{prog}: {message}")


class OutputFileError(KsimError):
    """A file a command is told to write (``ksim bench --output``, ``--plot``) cannot
    be: a directory, or in a directory that does not exist or cannot be written.
    Refused before anything runs."""

    code = "output-file"


class UnknownSymbol(KsimError):
    """No function or symbol by that name; ``suggestions`` holds close names."""

    code = "unknown-symbol"

    def __init__(self, name: str, suggestions: list[str] | tuple[str, ...] = ()) -> None:
        self.name = name
        self.suggestions = list(suggestions)
        hint = f"; did you mean {', '.join(self.suggestions)}?" if self.suggestions else ""
        super().__init__(f"unknown function or symbol {name!r}{hint}")


# --- analysis -----------------------------------------------------------------
class AnalysisError(KsimError):
    code = "analysis"


class DecodeError(AnalysisError):
    """Bytes that do not decode as an instruction."""

    code = "decode"


# --- snippets / codegen ---------------------------------------------------------
class SnippetError(KsimError):
    """An ill-formed snippet, rejected before any code is generated."""

    code = "snippet"


class SlotError(SnippetError):
    """A node of the wrong kind in a slot (a non-node operand, a statement as a value)."""

    code = "snippet-slot"


class NotAssignable(SlotError):
    """The target of an assignment is not a variable (e.g. a constant)."""

    code = "not-assignable"


class PointKindError(SnippetError):
    """A node that has no meaning at this kind of point (Arg off entry, RetVal off exit)."""

    code = "point-kind"


class DivisionByZero(SnippetError):
    """Division or modulo by a constant zero."""

    code = "division-by-zero"


class ArgIndexError(SnippetError):
    """Arg(n) with n outside the registers that carry arguments."""

    code = "arg-index"


class TooManyCallArgs(SnippetError):
    """A call with more arguments than the calling convention passes in registers."""

    code = "too-many-call-args"


class BadOperand(SnippetError):
    """An operand out of its domain: a constant wider than 64 bits, a bad access size."""

    code = "bad-operand"


class NotIndirectCall(PointKindError):
    """CallTarget at a point that is not an indirect call (no destination to read)."""

    code = "not-indirect-call"


class CallOperandError(SnippetError):
    """CallTarget at an indirect call whose operand snippet code cannot evaluate
    (segment-relative memory, 32-bit addressing)."""

    code = "call-operand"


class UnknownRegister(SnippetError):
    """Reg(name) with a name that is not a general-purpose register of the architecture."""

    code = "unknown-register"


class CodegenError(KsimError):
    code = "codegen"


# --- splicing -------------------------------------------------------------------
class SpliceError(KsimError):
    """A point cannot be spliced (or unspliced) as asked.  Nothing was changed."""

    code = "splice"


class NotOnBoundary(SpliceError):
    """The address is not the start of an instruction of its function."""

    code = "not-on-boundary"


class OutsideText(SpliceError):
    """The address is not inside kernel text (or not inside a known function)."""

    code = "outside-text"


class JumpOutside(OutsideText):
    """On a live kernel, a text write that makes (or changes) a jump leading
    neither into kernel or module text nor into a patch block of the client's own:
    the kernel module refuses it.  Nothing was written."""

    code = "jump-outside"


class OutOfRange(SpliceError):
    """A branch cannot reach its destination with the encoding asked for."""

    code = "out-of-range"


class UnsafeSite(SpliceError):
    """The kernel relies on the instruction at this address staying where it is
    and as it is: it finds it by address or rewrites it itself.  Such an
    instruction is never overwritten or moved into a patch."""

    code = "unsafe-site"


class Blacklisted(UnsafeSite):
    """The point lies in code that must never be instrumented (the trap path itself,
    entry and noinstr text, the kprobes blacklist)."""

    code = "blacklisted"


class BugSite(UnsafeSite):
    """A WARN/BUG ``ud2`` with a ``__bug_table`` entry: moved, ``handle_bug`` would
    no longer find it and a WARN would become an invalid-opcode oops."""

    code = "bug-site"


class ExtableSite(UnsafeSite):
    """An instruction with an ``__ex_table`` fix-up: moved, a fault in it would oops."""

    code = "extable-site"


class FtraceSite(UnsafeSite):
    """An ftrace location (``__mcount_loc``): the kernel rewrites it when tracing starts."""

    code = "ftrace-site"


class JumpLabelSite(UnsafeSite):
    """A jump-label site (``__jump_table``): the kernel rewrites it when a static key flips."""

    code = "jump-label-site"


class StaticCallSite(UnsafeSite):
    """A static-call site (``.static_call_sites``): the kernel rewrites its call."""

    code = "static-call-site"


class ProbedSite(UnsafeSite):
    """The kernel's own kprobe (or another instrumenter's breakpoint) sits there:
    the text is not the original."""

    code = "probed-site"


class NoSafeTactic(SpliceError):
    """No tactic the policy allows can splice this point; ``reasons`` says why, per tactic."""

    code = "no-safe-tactic"

    def __init__(self, address: int, reasons: dict[str, str]) -> None:
        self.address = address
        self.reasons = dict(reasons)
        why = "; ".join(f"{t}: {r}" for t, r in self.reasons.items())
        super().__init__(f"no safe tactic at {address:#x} ({why})")


class AlreadySpliced(SpliceError):
    """The point, or bytes a splice would overwrite, are already spliced incompatibly."""

    code = "already-spliced"


class RelocationError(SpliceError):
    """An instruction cannot be moved to the patch (e.g. a rel32 that no longer reaches)."""

    code = "relocation"


class CallInsideRun(RelocationError):
    """A call with instructions after it in a run to relocate: relocated, the return
    address it leaves would differ from the original's (a plain call pushes its
    copy's), and a call that leaves the original would return past the rest of the
    run.  Only a run's last instruction may be a call (or a call to the next
    instruction, which only pushes its address)."""

    code = "call-inside-run"


class OverlappingWrites(SpliceError):
    """A patch whose writes overlap: applying it would leave neither write intact."""

    code = "overlapping-writes"


class TrapUnavailable(SpliceError):
    """A trap at code that runs before the kernel's own trap dispatch exists (the
    function that installs it, or one it calls: an x86 IDT, an arm64 vector base
    not yet loaded): the kernel would die at boot.  A jump-based tactic may still
    splice the point."""

    code = "trap-unavailable"


class UnknownHandle(KsimError):
    code = "unknown-handle"


class BlockInUse(KsimError):
    """A heap block that an inserted snippet still references (writes, reads, or
    passes to a call): freed, it would be handed out again while the snippet still
    writes it.  The message names the splice; remove it first.  Nothing was freed."""

    code = "block-in-use"


class OutsideHeapBlock(BadArgument):
    """A write (``copy_to_kernel``, ``write``) whose bytes do not lie inside one heap
    block the caller allocated: past a block's end, across two blocks, or outside
    the heap.  Refused before anything is written."""

    code = "outside-heap-block"


class DuplicateHandle(BadArgument):
    """The same handle named twice in one request (remove_many): refused before
    anything was removed."""

    code = "duplicate-handle"


class UnknownPolicy(SpliceError, BadArgument):
    """A splice policy that does not exist (the message names those that do)."""

    code = "unknown-policy"


# --- targets ----------------------------------------------------------------------
class TargetError(KsimError):
    code = "target"


class TargetFault(TargetError):
    """Reading or writing target memory failed (bad address)."""

    code = "target-fault"


class StaleText(TargetError):
    """A poke's expected old bytes do not match what is in memory; nothing was written."""

    code = "stale-text"


class OutOfMemory(TargetError):
    """The patch area or data heap has no room left."""

    code = "out-of-memory"


class TrapTableFull(OutOfMemory):
    """The target's table of trap routes has no room for the sites a change routes;
    nothing was changed."""

    code = "trap-table-full"


class NotPrivileged(TargetError):
    """The kernel module refuses a caller without CAP_SYS_ADMIN: opening
    /dev/kerninst, or any command but VERSION (a descriptor passed on, or the
    capability dropped since it was opened).  Nothing was changed."""

    code = "not-privileged"


class LockedDown(TargetError):
    """The running kernel is locked down (``/sys/kernel/security/lockdown``): the
    module refuses to change its text, trap routes or patch code, as the kernel
    refuses its own debuggers' writes (LOCKDOWN_DBG_WRITE_KERNEL).  Undoing what
    is already there still works.  Nothing was changed."""

    code = "locked-down"


class TargetDied(TargetError):
    """The target (an emulator process, a connection) went away."""

    code = "target-died"


class TargetTimeout(TargetError):
    code = "target-timeout"


class RunOptionError(TargetError):
    """A run asked for with an option or value the target cannot honour; nothing ran."""

    code = "run-option"


class UnknownRunOption(RunOptionError, TypeError):
    """An option the target's run does not take: a typo, or another kind of target's option."""

    code = "unknown-run-option"


class BadRunValue(RunOptionError, ValueError):
    """A run option with an impossible value (a negative count, a timeout that is
    not a positive number of seconds, a progress callback that cannot be called)."""

    code = "bad-run-value"


class UnknownOracle(TargetError):
    """An oracle kind that does not exist, or that the target does not have."""

    code = "unknown-oracle"


class EmulationError(TargetError):
    """The emulated kernel faulted (unmapped access, invalid instruction...)."""

    code = "emulation"


# --- wire (live) -----------------------------------------------------------------
class ProtocolError(KsimError):
    """A malformed or unexpected message on the wire."""

    code = "protocol"


class AuthError(KsimError):
    code = "auth"


class TokenFileError(AuthError):
    """The token file given (or the testbed's default) cannot be read: missing, a
    directory, unreadable or empty.  Nothing was sent."""

    code = "token-file"


# --- probes, timers, replacement, components ----------------------------------------
class ProbeError(KsimError):
    """A probe cannot be registered as asked.  Nothing was changed."""

    code = "probe"


class ProbeExists(ProbeError):
    """A probe is already registered at that address (or this probe is registered)."""

    code = "probe-exists"


class HandlerUnsupported(ProbeError):
    """A Python handler on a target that cannot call into Python at a trap, or a
    post handler after an instruction that does not fall through."""

    code = "handler-unsupported"


class NoReturnPoint(ProbeError):
    """A return probe on a function that leaves by a tail call (no ret to watch)."""

    code = "no-return-point"


class ReplacementError(SpliceError):
    """A function or call site cannot be replaced as asked.  Nothing was changed."""

    code = "replacement"


class LinkError(KsimError):
    """A component object cannot be loaded: unresolved symbol, unsupported relocation."""

    code = "link"


class ComponentUnsupported(LinkError):
    """Components are not available on the kernel's architecture (the loader links
    another architecture's objects); nor is what is built on them (timers)."""

    code = "component-unsupported"


class ComponentBuildError(LinkError):
    """Compiling a component from C failed."""

    code = "component-build"


# --- snippet verifier (ksim.snippets.verify) -------------------------------------------
class VerifierError(SnippetError):
    """The verifier refused a snippet: it could harm the kernel.  Nothing was compiled."""

    code = "verifier"


class WriteOutsideHeap(VerifierError):
    """An assignment to memory outside the heap blocks the session owns (kernel text,
    kernel data, past a block's end, a per-cpu variable, the recursion guard)."""

    code = "write-outside-heap"


class ReadOutsideKnownMemory(VerifierError):
    """A read at a constant address that is not known to be mapped, with no
    fault-safe way to read it (or known to be unmapped)."""

    code = "read-outside-known-memory"


class UnsafeLoad(VerifierError):
    """A load through a computed pointer on a kernel whose ABI offers no fault-safe read."""

    code = "unsafe-load"


class CallNotAllowed(VerifierError):
    """A call to a function the user did not name as callable."""

    code = "call-not-allowed"


class NoRecursionGuard(VerifierError):
    """A snippet that calls out, verified without a recursion guard to run it under."""

    code = "no-recursion-guard"


class TextOwned(AlreadySpliced):
    """On a live kernel, another owner holds these bytes, this trap route, this
    block or this name: another client's session, or a kept splice.  The kernel
    module refuses to let one owner change what another holds; nothing was changed."""

    code = "text-owned"


class KeptNameTaken(TextOwned):
    """``keep`` under a name another kept splice already has: the module keeps one
    owner per name.  Nothing was changed; adopt or remove that one, or choose
    another name."""

    code = "kept-name-taken"


def all_error_classes() -> dict[str, type[KsimError]]:
    """Map each wire code to its class (used by the daemon and the live client)."""
    out: dict[str, type[KsimError]] = {}
    stack: list[type[KsimError]] = [KsimError]
    while stack:
        cls = stack.pop()
        out[cls.code] = cls
        stack.extend(cls.__subclasses__())
    return out
