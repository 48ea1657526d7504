"""The snippet verifier: what a snippet may do to the kernel, decided before any
code is compiled (in the spirit of eBPF's verifier, kernel/bpf/verifier.c).

* **Writes** go only to heap blocks the session owns: every ``Assign`` and
  ``AtomicAssign`` target is an absolute ``Var`` lying entirely inside one of
  ``rules.writable`` (its address and size are known here, so the bounds are
  checked statically), and never over the recursion guard.
* **Reads** cannot fault.  A read at a constant address (a ``Var``, or a ``Load``
  of a ``Const``) known to be mapped -- an owned block, the guard, a region of
  ``rules.readable``, a location the ABI declares -- stays a plain load.  Any other
  load is compiled fault-safe the way the kernel's ABI offers (``readable``: checked
  inline, 0 outside; ``read_nofault``: through copy_from_kernel_nofault, 0 on a
  fault); with neither, it is refused, and so is a constant address the ABI's map
  shows unmapped.  Per-cpu (gs-relative) reads must lie in what the ABI declares
  (current_task, cpu_number) or in ``rules.percpu``.
* **Calls** go only to the addresses in ``rules.calls``, which the user names
  explicitly (plain ints, compared as such: an int subclass, which may say it
  equals an allowed address, is refused).  A snippet that calls out (a ``Call``,
  or a load through ``read_nofault``) runs under ``rules.guard``, a per-cpu
  recursion guard: a hit while the cpu already runs a guarded snippet is counted
  in ``guard.missed`` and skipped (kprobes' ``nmissed``, BPF's
  ``bpf_prog_active``), so a snippet calling the function it instruments nests
  once instead of until the stack overflows.
  Every calling snippet is guarded, whatever it calls: what a callee reaches
  (indirect calls, points inserted later) is not known when it is compiled.

Usage (what the Manager does for every snippet it inserts, after ``check``)::

    rules = Rules.for_target(target, writable=owned_blocks, calls=allowed, guard=guard)
    compiled = verify([snippet], rules)[0]      # raises a VerifierError subclass
    ... arch.compile_snippets([compiled, ...], address, abi=target.abi, ...)

``verify`` is pure: it returns the snippets to compile (reads rewritten, calling
snippets wrapped in ``Guarded``) and changes nothing.  Its input is a checked
snippet (ksim.snippets.check); its output passes the check too.  A snippet it
returned may be verified again under the same rules: a top-level ``Guarded`` with
``rules.guard`` is taken as its own output and not wrapped twice.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ksim.errors import (
    CallNotAllowed,
    NoRecursionGuard,
    NotAssignable,
    ReadOutsideKnownMemory,
    SlotError,
    UnsafeLoad,
    WriteOutsideHeap,
)

from . import ast
from .ast import Guard
from .codegen import read_mode, uses_calls

if TYPE_CHECKING:
    from ksim.core import KernelABI
    from ksim.targets.base import Target

_MASK64 = (1 << 64) - 1

#: (start, size) of a block of memory
Block = tuple[int, int]


@dataclass(frozen=True)
class Rules:
    """What the snippets of one session may touch.  Blocks are (start, size)."""

    #: the heap blocks the session owns: the only memory snippets may write
    writable: tuple[Block, ...] = ()
    #: memory known to be mapped (the image's sections): constant reads there are plain
    readable: tuple[Block, ...] = ()
    #: kernel text (for the refusal's message: writes there are refused like any other)
    text: tuple[Block, ...] = ()
    #: per-cpu (gs-relative) offsets snippets may read, beyond those the ABI declares
    percpu: tuple[Block, ...] = ()
    #: address -> name of every function a snippet may call
    calls: Mapping[int, str] = field(default_factory=dict)
    #: the recursion guard calling snippets run under (None: calling snippets are refused)
    guard: Guard | None = None
    #: the kernel's ABI: its declared locations and its fault-safe read
    abi: KernelABI | None = None

    @classmethod
    def for_target(cls, target: Target, *, writable: Iterable[Block] = (),
                   calls: Mapping[int, str] | None = None, guard: Guard | None = None,
                   percpu: Iterable[Block] = ()) -> Rules:
        """Rules for snippets on ``target``: its image's sections are readable (and
        its executable ones text), its ABI decides how other reads are made safe."""
        sections = [s for s in target.image.sections if s.address and s.size]
        return cls(
            writable=tuple(writable),
            readable=tuple((s.address, s.size) for s in sections),
            text=tuple((s.address, s.size) for s in sections if s.executable),
            percpu=tuple(percpu),
            calls=dict(calls or {}),
            guard=guard,
            abi=target.abi,
        )


def verify(snippets: Sequence[ast.Node], rules: Rules) -> list[ast.Node]:
    """The snippets to compile in place of ``snippets``, or a VerifierError
    subclass naming the first thing one of them may not do."""
    return [_Verifier(rules).snippet(s) for s in snippets]


class _Verifier:
    def __init__(self, rules: Rules) -> None:
        self.rules = rules
        self.abi = rules.abi
        self.mode = read_mode(rules.abi)
        # exactly ints, on both sides of the lookup: an int subclass may say it equals
        # (and hashes as) an allowed address while its value is another one
        self.calls = frozenset(a for a in rules.calls if type(a) is int)
        #: the blocks ``_known`` reads in (made when first asked)
        self._known_blocks: list[Block] | None = None

    def snippet(self, node: Any) -> ast.Node:
        g = self.rules.guard
        if isinstance(node, ast.Guarded) and g is not None and node.guard == g:
            return ast.Guarded(self.rewrite(node.body), g)     # verified before
        out = self.rewrite(node)
        if not uses_calls(out, self.abi):
            return out
        if g is None:
            raise NoRecursionGuard("a snippet that calls out runs under a recursion guard, "
                                   "and these rules give none (Rules.guard)")
        return ast.Guarded(out, g)

    def rewrite(self, node: Any) -> Any:
        return ast.substitute(node, self._node)

    def _node(self, node: ast.Node) -> ast.Node | None:
        """The replacement of one node (None: keep it, visit its children)."""
        if type(node) in _PLAIN:
            return None
        if isinstance(node, ast.Assign | ast.AtomicAssign):
            self._write(node.target)
            return _replaced(node, target=self._target(node.target), value=self.rewrite(node.value))
        if isinstance(node, ast.CompareExchange):
            self._write(node.target)
            return _replaced(node, target=self._target(node.target),
                             expected=self.rewrite(node.expected), new=self.rewrite(node.new))
        if isinstance(node, ast.Var):
            return self._read_var(node)
        if isinstance(node, ast.Elem):
            return self._read_elem(node)
        if isinstance(node, ast.Load):
            return self._load(node)
        if isinstance(node, ast.Call):
            self._call(node)
        elif isinstance(node, ast.Guarded):
            raise SlotError("Guarded is the verifier's own wrapping, not part of a snippet")
        return None

    # --- writes -------------------------------------------------------------------------
    def _target(self, target: Any) -> Any:
        """An assignment's target with its index (an Elem's) verified as a read."""
        if isinstance(target, ast.Elem):
            return _replaced(target, index=self.rewrite(target.index))
        return target

    def _write(self, target: Any) -> None:
        if isinstance(target, ast.Local):
            return              # the snippet's own stack
        if isinstance(target, ast.Elem):
            # the index is clamped to the table: the whole table is what may be written
            start, size = target.table
            self._write_range(start, start + size, f"table of {target.count} {target.size}-byte "
                              f"elements at {start:#x}")
            return
        if not isinstance(target, ast.Var):
            raise NotAssignable(f"cannot assign to {type(target).__name__}: only a Var, an Elem "
                                "or a Local can be assigned")
        where = f"{target.size}-byte Var at {target.address:#x}"
        if target.segment is not None:
            raise WriteOutsideHeap(f"{where} is {target.segment}-relative (per-cpu data); snippets "
                                   "write only the heap blocks they own, which are absolute")
        start, end = target.address & _MASK64, (target.address & _MASK64) + target.size
        self._write_range(start, end, where)

    def _write_range(self, start: int, end: int, where: str) -> None:
        g = self.rules.guard
        if g is not None and _overlaps(start, end, (g.address, g.size)):
            raise WriteOutsideHeap(f"{where} overlaps the recursion guard at {g.address:#x}")
        if any(_inside(start, end, b) for b in self.rules.writable):
            return
        for b in self.rules.text:
            if _overlaps(start, end, b):
                raise WriteOutsideHeap(f"{where} would write kernel text ({_block(b)})")
        for b in self.rules.writable:
            if _overlaps(start, end, b):
                raise WriteOutsideHeap(f"{where} runs past the heap block {_block(b)}")
        raise WriteOutsideHeap(f"{where} is not inside a heap block this session owns "
                               "(allocate the variable with malloc)")

    # --- reads --------------------------------------------------------------------------
    def _read_elem(self, node: ast.Elem) -> ast.Node:
        start, size = node.table
        if not self._known(start, start + size):
            raise ReadOutsideKnownMemory(f"table of {node.count} {node.size}-byte elements at "
                                         f"{start:#x} is not in memory known to be mapped")
        return _replaced(node, index=self.rewrite(node.index))

    def _read_var(self, var: ast.Var) -> ast.Node:
        if var.segment is not None:
            if self._percpu_readable(var):
                return var
            raise ReadOutsideKnownMemory(
                f"{var.size}-byte Var at {var.segment}:{var.address:#x} is per-cpu data neither "
                "the ABI nor the rules declare")
        address = var.address & _MASK64
        if self._known(address, address + var.size):
            return var
        return self._unknown_read(address, var.size, var.signed)

    def _load(self, load: ast.Load) -> ast.Node:
        ptr = self.rewrite(load.ptr)
        if isinstance(ptr, ast.Const) and not load.user:
            # a constant pointer: as known as a Var's address
            address = ptr.value & _MASK64
            if self._known(address, address + load.size):
                return ast.Var(address, load.size, load.signed)
            return self._unknown_read(address, load.size, load.signed)
        if self.mode == "plain":
            raise UnsafeLoad("a load through a computed pointer could fault, and the kernel's ABI "
                             "offers no fault-safe read (KernelABI.readable or read_nofault)")
        if ptr is load.ptr and type(load) is ast.Load:
            return load         # nothing to rewrite: the node itself, as substitute keeps it
        return ast.Load(ptr, load.size, load.signed, load.user)

    def _unknown_read(self, address: int, size: int, signed: bool) -> ast.Node:
        """A read at a constant address not known to be mapped: a fault-safe Load,
        or refused."""
        what = f"{size}-byte read at {address:#x}"
        if self.mode == "checked":
            # the ABI's map is the whole map: this read could only ever yield 0
            raise ReadOutsideKnownMemory(f"{what} is outside the kernel's memory map")
        if self.mode == "nofault":
            return ast.Load(ast.Const(address), size, signed)
        raise ReadOutsideKnownMemory(f"{what} is not in memory known to be mapped, and the "
                                     "kernel's ABI offers no fault-safe read")

    def _known(self, start: int, end: int) -> bool:
        blocks = self._known_blocks
        if blocks is None:
            blocks = list(self.rules.writable) + list(self.rules.readable)
            g = self.rules.guard
            if g is not None:
                blocks.append((g.address, g.size))
            if self.abi is not None:
                blocks += [(r.start, r.size) for r in self.abi.readable]
                blocks += [(m.address, m.size) for m in _memrefs(self.abi) if m.segment is None]
            self._known_blocks = blocks
        return any(_inside(start, end, b) for b in blocks)

    def _percpu_readable(self, var: ast.Var) -> bool:
        start, end = var.address & _MASK64, (var.address & _MASK64) + var.size
        blocks = list(self.rules.percpu)
        if self.abi is not None:
            blocks += [(m.address, m.size) for m in _memrefs(self.abi) if m.segment == var.segment]
        return any(_inside(start, end, b) for b in blocks)

    # --- calls --------------------------------------------------------------------------
    def _call(self, node: ast.Call) -> None:
        address = node.address
        if type(address) is not int:
            raise CallNotAllowed(f"a call's address must be a plain int, not {type(address).__name__}: "
                                 "snippets call only the functions named as callable")
        if address in self.calls:
            return
        allowed = ", ".join(f"{n} ({a:#x})" for a, n in sorted(self.rules.calls.items())) or "none"
        raise CallNotAllowed(f"call to {node.address:#x} is not allowed: snippets call only the "
                             f"functions named as callable (allowed: {allowed}); allow it with "
                             "Manager.allow_calls")


#: node classes ``_node`` keeps as they are (exactly these: a subclass of any node
#: class goes through every test)
_PLAIN = frozenset({
    ast.Const, ast.BinOp, ast.Unary, ast.Compare, ast.LogicalAnd, ast.LogicalOr, ast.LogicalNot,
    ast.If, ast.Seq, ast.Tsc, ast.Pid, ast.Tgid, ast.CurrentTask, ast.Comm, ast.Cpu, ast.Arg,
    ast.RetVal, ast.Reg, ast.CallTarget, ast.Frame, ast.Local, ast.LocalAddress,
})


def _replaced(node: Any, **fields: Any) -> Any:
    """``node`` with ``fields`` replaced; ``node`` itself when every one is the
    object it already holds (a verified tree that needs no rewriting is the tree
    itself, so that the check it passed is not run on a copy)."""
    if all(getattr(node, k) is v for k, v in fields.items()):
        return node
    return dataclasses.replace(node, **fields)


def _memrefs(abi: KernelABI) -> list[Any]:
    return [m for m in (abi.current_task, abi.cpu_number) if m is not None]


def _inside(start: int, end: int, block: Block) -> bool:
    return block[0] <= start and end <= block[0] + block[1]


def _overlaps(start: int, end: int, block: Block) -> bool:
    return start < block[0] + block[1] and block[0] < end


def _block(b: Block) -> str:
    return f"{b[0]:#x}..{b[0] + b[1]:#x}"


__all__ = ["Block", "Guard", "Rules", "verify"]
