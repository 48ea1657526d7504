"""Snippet AST: the public API that only builds nodes (KAPI's ``kapi_snippet``).

Nodes are immutable.  Python operators build nodes, so a counter increment is
``counter.assign(counter + 1)`` and a predicate is ``(pid() == 42)``; logical
operators, which Python does not let a class overload, are the functions
:func:`land`, :func:`lor` and :func:`lnot`.  Because ``==`` builds a node,
nodes have no truth value (``if node:`` raises TypeError) and hash by identity;
compare trees structurally with :func:`same`.

Semantics (what the generated code computes, on every architecture)
-------------------------------------------------------------------
* Every value is a 64-bit two's-complement integer; arithmetic wraps modulo 2**64.
* ``/`` and ``%`` are *signed and truncating* like C99: the quotient is rounded
  toward zero and the remainder has the sign of the dividend.  Neither traps (a
  kernel cannot afford a #DE): ``x / 0 == -1`` and ``x % 0 == x``; ``MIN / -1 ==
  MIN`` and ``MIN % -1 == 0`` (the RISC-V convention, RISC-V ISA Vol. I, "M"
  extension, Table 7.1).
* ``<``, ``<=``, ``>``, ``>=`` compare signed; :func:`ult` and friends compare
  unsigned; ``==``/``!=`` compare bits.  Comparisons and logical operators yield 0 or 1.
* ``<<`` and ``>>`` take the count modulo 64; ``>>`` is arithmetic (signed),
  :func:`lshr` is the logical shift.
* ``land``/``lor`` short-circuit: the right operand is evaluated only if needed.
* A variable or load of fewer than 8 bytes is zero-extended, or sign-extended
  when ``signed=True``; assignment stores the low bytes and yields the value
  the variable then holds (read back with the same extension).
* ``If`` yields the value of the branch taken, 0 when the condition is false and
  there is no else branch; ``Seq`` yields its last value (0 when empty).
* ``AtomicAssign`` is atomic on SMP: ``v.atomic_assign(v + e)`` (or ``- e``)
  becomes one locked add; anything else a compare-and-swap loop in which every
  read of ``v`` inside the value sees the same snapshot.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from dataclasses import replace as _replace
from functools import lru_cache
from typing import Any

#: 8-byte words of a task's name (Linux's TASK_COMM_LEN is 16)
COMM_WORDS = 2

_MASK64 = (1 << 64) - 1


def lift(value: Any) -> Node:
    """A node as is; a Python int as a Const; anything else is left for the check to refuse."""
    if isinstance(value, Node):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return Const(value)
    return value  # type: ignore[no-any-return]


class Node:
    """Base of every snippet node."""

    __slots__ = ()

    # arithmetic
    def __add__(self, o: Any) -> BinOp: return BinOp("add", self, lift(o))
    def __radd__(self, o: Any) -> BinOp: return BinOp("add", lift(o), self)
    def __sub__(self, o: Any) -> BinOp: return BinOp("sub", self, lift(o))
    def __rsub__(self, o: Any) -> BinOp: return BinOp("sub", lift(o), self)
    def __mul__(self, o: Any) -> BinOp: return BinOp("mul", self, lift(o))
    def __rmul__(self, o: Any) -> BinOp: return BinOp("mul", lift(o), self)
    def __truediv__(self, o: Any) -> BinOp: return BinOp("div", self, lift(o))
    def __rtruediv__(self, o: Any) -> BinOp: return BinOp("div", lift(o), self)
    def __mod__(self, o: Any) -> BinOp: return BinOp("mod", self, lift(o))
    def __rmod__(self, o: Any) -> BinOp: return BinOp("mod", lift(o), self)
    def __and__(self, o: Any) -> BinOp: return BinOp("and", self, lift(o))
    def __rand__(self, o: Any) -> BinOp: return BinOp("and", lift(o), self)
    def __or__(self, o: Any) -> BinOp: return BinOp("or", self, lift(o))
    def __ror__(self, o: Any) -> BinOp: return BinOp("or", lift(o), self)
    def __xor__(self, o: Any) -> BinOp: return BinOp("xor", self, lift(o))
    def __rxor__(self, o: Any) -> BinOp: return BinOp("xor", lift(o), self)
    def __lshift__(self, o: Any) -> BinOp: return BinOp("shl", self, lift(o))
    def __rlshift__(self, o: Any) -> BinOp: return BinOp("shl", lift(o), self)
    def __rshift__(self, o: Any) -> BinOp: return BinOp("sar", self, lift(o))
    def __rrshift__(self, o: Any) -> BinOp: return BinOp("sar", lift(o), self)
    def __neg__(self) -> Unary: return Unary("neg", self)
    def __invert__(self) -> Unary: return Unary("not", self)

    # comparisons build nodes (signed)
    def __eq__(self, o: object) -> Compare: return Compare("eq", self, lift(o))  # type: ignore[override]
    def __ne__(self, o: object) -> Compare: return Compare("ne", self, lift(o))  # type: ignore[override]
    def __lt__(self, o: Any) -> Compare: return Compare("lt", self, lift(o))
    def __le__(self, o: Any) -> Compare: return Compare("le", self, lift(o))
    def __gt__(self, o: Any) -> Compare: return Compare("gt", self, lift(o))
    def __ge__(self, o: Any) -> Compare: return Compare("ge", self, lift(o))

    __hash__ = object.__hash__

    def __bool__(self) -> bool:
        raise TypeError("a snippet node has no truth value; use land/lor/lnot to combine conditions")

    # assignment
    def assign(self, value: Any) -> Assign:
        return Assign(self, lift(value))

    def atomic_assign(self, value: Any) -> AtomicAssign:
        return AtomicAssign(self, lift(value))

    def children(self) -> tuple[Any, ...]:
        """The operands (child slots) of this node, in evaluation order."""
        return ()


# Node dataclasses are frozen, and eq=False keeps Node's operator methods.


@dataclass(frozen=True, eq=False, slots=True)
class Const(Node):
    value: int


@dataclass(frozen=True, eq=False, slots=True)
class Var(Node):
    """An integer variable in kernel memory (absolute, or per-cpu when segment="gs")."""

    address: int
    size: int = 8
    signed: bool = False
    segment: str | None = None

    @property
    def key(self) -> tuple[int, str | None]:
        return (self.address & _MASK64, self.segment)


@dataclass(frozen=True, eq=False, slots=True)
class BinOp(Node):
    """add sub mul div mod and or xor shl sar shr"""

    op: str
    left: Any
    right: Any

    def children(self) -> tuple[Any, ...]:
        return (self.left, self.right)


@dataclass(frozen=True, eq=False, slots=True)
class Unary(Node):
    """neg (two's complement) or not (bitwise)"""

    op: str
    operand: Any

    def children(self) -> tuple[Any, ...]:
        return (self.operand,)


@dataclass(frozen=True, eq=False, slots=True)
class Compare(Node):
    """eq ne lt le gt ge (signed), ult ule ugt uge (unsigned); yields 0 or 1."""

    op: str
    left: Any
    right: Any

    def children(self) -> tuple[Any, ...]:
        return (self.left, self.right)


@dataclass(frozen=True, eq=False, slots=True)
class LogicalAnd(Node):
    left: Any
    right: Any

    def children(self) -> tuple[Any, ...]:
        return (self.left, self.right)


@dataclass(frozen=True, eq=False, slots=True)
class LogicalOr(Node):
    left: Any
    right: Any

    def children(self) -> tuple[Any, ...]:
        return (self.left, self.right)


@dataclass(frozen=True, eq=False, slots=True)
class LogicalNot(Node):
    operand: Any

    def children(self) -> tuple[Any, ...]:
        return (self.operand,)


@dataclass(frozen=True, eq=False, slots=True)
class Assign(Node):
    target: Any
    value: Any

    def children(self) -> tuple[Any, ...]:
        return (self.target, self.value)


@dataclass(frozen=True, eq=False, slots=True)
class AtomicAssign(Node):
    target: Any
    value: Any

    def children(self) -> tuple[Any, ...]:
        return (self.target, self.value)


@dataclass(frozen=True, eq=False, slots=True)
class If(Node):
    cond: Any
    then: Any
    orelse: Any = None

    def children(self) -> tuple[Any, ...]:
        return (self.cond, self.then) if self.orelse is None else (self.cond, self.then, self.orelse)


@dataclass(frozen=True, eq=False, slots=True)
class Seq(Node):
    body: tuple[Any, ...] = ()

    def children(self) -> tuple[Any, ...]:
        return tuple(self.body)


@dataclass(frozen=True, eq=False, slots=True)
class Call(Node):
    """Call a kernel function at ``address`` (already resolved) with up to 6 arguments."""

    address: int
    args: tuple[Any, ...] = ()

    def children(self) -> tuple[Any, ...]:
        return tuple(self.args)


@dataclass(frozen=True, eq=False, slots=True)
class Tsc(Node):
    """The processor's cycle counter (KAPI's HWC_TICKS)."""


@dataclass(frozen=True, eq=False, slots=True)
class Pid(Node):
    """The pid of the current task (KAPI's kapi_pid_expr), via the KernelABI."""


@dataclass(frozen=True, eq=False, slots=True)
class Tgid(Node):
    """The thread-group id of the current task (a process's pid, where Pid is the
    thread's), via the KernelABI; the Pid where the kernel has no thread groups."""


@dataclass(frozen=True, eq=False, slots=True)
class Comm(Node):
    """Bytes ``8*word`` to ``8*word+7`` of the current task's name (``comm``, NUL
    padded), little-endian, via the KernelABI."""

    word: int

    def __post_init__(self) -> None:
        if not isinstance(self.word, int) or not 0 <= self.word < COMM_WORDS:
            raise TypeError(f"Comm word must be 0..{COMM_WORDS - 1}, got {self.word!r}")


@dataclass(frozen=True, eq=False, slots=True)
class CurrentTask(Node):
    """The address of the current task's structure (bpftrace's ``curtask``), via
    the KernelABI."""


@dataclass(frozen=True, eq=False, slots=True)
class Cpu(Node):
    """The number of the cpu running the snippet, via the KernelABI."""


@dataclass(frozen=True, eq=False, slots=True)
class Arg(Node):
    """The n-th argument (from 0) of the function, at its entry point."""

    n: int


@dataclass(frozen=True, eq=False, slots=True)
class RetVal(Node):
    """The function's return value, at an exit point."""


@dataclass(frozen=True, eq=False, slots=True)
class Reg(Node):
    """The value a general-purpose register (64-bit name: "rax", "rsp", "r11") had
    when the point was reached, at any kind of point."""

    name: str


@dataclass(frozen=True, eq=False, slots=True)
class CallTarget(Node):
    """At the point of an indirect call, the address it is about to call: its
    register, or the 8 bytes at its memory operand ``[base + index*scale + disp]``
    computed from the registers at the point (KAPI's callee watching)."""


@dataclass(frozen=True, eq=False, slots=True)
class Load(Node):
    """``size`` bytes read through the pointer ``ptr`` (zero- or sign-extended);
    ``user``: ``ptr`` is a user-space address (read with the kernel's user-memory
    reader where it has one)."""

    ptr: Any
    size: int = 8
    signed: bool = False
    user: bool = False

    def children(self) -> tuple[Any, ...]:
        return (self.ptr,)


@dataclass(frozen=True, eq=False, slots=True)
class Frame(Node):
    """``body`` run with ``slots`` scratch variables, ``Local(0)`` .. ``Local(slots - 1)``,
    each 8 bytes and 0 when the body starts.  They live on the snippet's own stack,
    so every hit (and every cpu) has its own: they need no heap block and are never
    shared.  Frames do not nest.  Yields the body's value."""

    slots: int
    body: Any

    def children(self) -> tuple[Any, ...]:
        return (self.body,)


@dataclass(frozen=True, eq=False, slots=True)
class Local(Node):
    """Scratch variable ``slot`` of the enclosing Frame (read it, or ``assign`` it)."""

    slot: int


@dataclass(frozen=True, eq=False, slots=True)
class LocalAddress(Node):
    """The address of scratch variable ``slot`` of the enclosing Frame.  Slots lie
    downward in memory, the architecture's slot size apart (``StackABI.slot_bytes``:
    8 bytes on x86-64, 16 on AArch64, a Local's value in a slot's first 8): the
    ``n`` slots from ``s`` are one buffer at the address of slot ``s + n - 1`` (what
    a called function may fill: a kernel's stack unwinder)."""

    slot: int


@dataclass(frozen=True, eq=False, slots=True)
class Elem(Node):
    """Element ``index`` of a table of ``count`` integers of ``size`` bytes at
    ``base``: the integer at ``base + size * min(index, count - 1)``, the index
    taken unsigned.  Clamping keeps every access inside the table whatever the
    index computes to, so the verifier checks the table's bounds, not the index.
    The index must have no side effects.  Read it, ``assign`` or ``atomic_assign``
    it, or use it as a CompareExchange target, like a Var."""

    base: int
    count: int
    index: Any
    size: int = 8
    signed: bool = False

    def children(self) -> tuple[Any, ...]:
        return (self.index,)

    @property
    def table(self) -> tuple[int, int]:
        """(start, size in bytes) of the whole table."""
        return (self.base & _MASK64, self.count * self.size)


@dataclass(frozen=True, eq=False, slots=True)
class CompareExchange(Node):
    """Atomically: if ``target`` (a Var or an Elem) holds ``expected``, store ``new``
    there.  Yields the value ``target`` held before, zero-extended (so the store
    happened exactly when that equals ``expected``): one ``lock cmpxchg``, never a
    loop.  The target's address is computed first, then ``expected``, then ``new``."""

    target: Any
    expected: Any
    new: Any

    def children(self) -> tuple[Any, ...]:
        return (self.target, self.expected, self.new)


@dataclass(frozen=True, slots=True)
class Guard:
    """A per-cpu recursion guard: one zeroed heap block holding the count of hits
    missed because the guard was held (8 bytes), then ``slots`` 8-byte flags.  A cpu
    holds flag ``cpu & (slots - 1)`` while it runs a guarded snippet; ``slots`` is a
    power of two, and cpus beyond it share flags (more misses, never more nesting)."""

    address: int
    slots: int = 1

    @staticmethod
    def size_for(slots: int) -> int:
        """Bytes of the heap block a guard with ``slots`` flags needs."""
        return 8 * (1 + slots)

    @staticmethod
    def slots_for(cpus: int) -> int:
        """The flags for a kernel with ``cpus`` cpus: the next power of two (one each)."""
        return 1 << max(cpus - 1, 0).bit_length()

    @property
    def size(self) -> int:
        return self.size_for(self.slots)

    @property
    def missed(self) -> int:
        """Address of the 8-byte count of missed hits."""
        return self.address

    def flag(self, slot: int) -> int:
        return self.address + 8 * (1 + slot)


@dataclass(frozen=True, eq=False, slots=True)
class Guarded(Node):
    """``body`` run under ``guard`` (the verifier wraps every snippet that calls
    out in one, as kprobes and BPF guard their handlers): the cpu's flag is taken
    atomically; if it was already held, the hit is counted in ``guard.missed`` and
    ``body`` does not run.  So a snippet that calls into code instrumented by
    itself, or by another guarded snippet, nests at most once per flag.
    A statement: its value is 0.  ``missed``, when given, is the address of the
    instrumentation's own 8-byte miss counter (a kprobe's nmissed), counted too."""

    body: Any
    guard: Guard
    missed: int | None = None

    def children(self) -> tuple[Any, ...]:
        return (self.body,)


Snippet = Node
Expr = Node | int


# --- builders that Python operators cannot express -------------------------------------
def land(a: Expr, b: Expr) -> LogicalAnd:
    return LogicalAnd(lift(a), lift(b))


def lor(a: Expr, b: Expr) -> LogicalOr:
    return LogicalOr(lift(a), lift(b))


def lnot(a: Expr) -> LogicalNot:
    return LogicalNot(lift(a))


def lshr(a: Expr, b: Expr) -> BinOp:
    return BinOp("shr", lift(a), lift(b))


def ult(a: Expr, b: Expr) -> Compare:
    return Compare("ult", lift(a), lift(b))


def ule(a: Expr, b: Expr) -> Compare:
    return Compare("ule", lift(a), lift(b))


def ugt(a: Expr, b: Expr) -> Compare:
    return Compare("ugt", lift(a), lift(b))


def uge(a: Expr, b: Expr) -> Compare:
    return Compare("uge", lift(a), lift(b))


def if_(cond: Expr, then: Expr, orelse: Expr | None = None) -> If:
    return If(lift(cond), lift(then), None if orelse is None else lift(orelse))


def seq(*body: Expr) -> Seq:
    return Seq(tuple(lift(b) for b in body))


def call(address: int, *args: Expr) -> Call:
    return Call(address, tuple(lift(a) for a in args))


def tsc() -> Tsc:
    return Tsc()


def pid() -> Pid:
    return Pid()


def tgid() -> Tgid:
    return Tgid()


def comm(word: int) -> Comm:
    return Comm(word)


def cpu() -> Cpu:
    return Cpu()


def arg(n: int) -> Arg:
    return Arg(n)


def retval() -> RetVal:
    return RetVal()


def reg(name: str) -> Reg:
    return Reg(name)


def call_target() -> CallTarget:
    return CallTarget()


def load(ptr: Expr, size: int = 8, signed: bool = False, user: bool = False) -> Load:
    return Load(lift(ptr), size, signed, user)


def frame(slots: int, *body: Expr) -> Frame:
    return Frame(slots, seq(*body))


def local(slot: int) -> Local:
    return Local(slot)


def elem(base: int, count: int, index: Expr, size: int = 8, signed: bool = False) -> Elem:
    return Elem(base, count, lift(index), size, signed)


def compare_exchange(target: Node, expected: Expr, new: Expr) -> CompareExchange:
    return CompareExchange(target, lift(expected), lift(new))


def same(a: Any, b: Any) -> bool:
    """Structural equality of two trees (``==`` builds a Compare node instead)."""
    if type(a) is not type(b):
        return False
    if not isinstance(a, Node):
        return bool(a == b)
    return all(_same_field(getattr(a, f.name), getattr(b, f.name)) for f in fields(a))  # type: ignore[arg-type]


def _same_field(x: Any, y: Any) -> bool:
    if isinstance(x, tuple) and isinstance(y, tuple):
        return len(x) == len(y) and all(same(p, q) for p, q in zip(x, y, strict=True))
    return same(x, y)


def walk(node: Any) -> Any:
    """Every node of a tree, parents before children (depth first, in order)."""
    stack = [node]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, Node):
            stack.extend(reversed(node.children()))


def substitute(node: Any, replace: Any) -> Any:
    """A copy of the tree in which every node for which ``replace(node)`` returns a
    node is that node instead (children of a replaced node are not visited).  A
    subtree in which nothing is replaced is kept as it is, not copied (nodes are
    immutable): a tree nothing changes comes back itself."""
    if not isinstance(node, Node):
        return node
    new = replace(node)
    if new is not None:
        return new
    changes = {}
    for name in _field_names(type(node)):  # type: ignore[arg-type]
        value = getattr(node, name)
        if type(value) in _SCALARS:
            continue            # no node in it: kept
        if isinstance(value, tuple | list):
            rebuilt: Any = tuple(substitute(v, replace) for v in value)
            if type(value) is tuple and all(r is v for r, v in zip(rebuilt, value, strict=True)):
                rebuilt = value     # nothing in it replaced: the tree is kept, not copied
        else:
            rebuilt = substitute(value, replace)
        if rebuilt is not value:
            changes[name] = rebuilt
    return _replace(node, **changes) if changes else node  # type: ignore[type-var]


#: field values that hold no node (exactly these types, not subclasses)
_SCALARS = frozenset({int, str, bool, bytes, type(None)})


@lru_cache(maxsize=256)
def _field_names(cls: type) -> tuple[str, ...]:
    """The fields of the node class ``cls``, in order (one entry a class)."""
    return tuple(f.name for f in fields(cls))  # type: ignore[arg-type]
