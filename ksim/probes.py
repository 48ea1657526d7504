"""Kprobes-style probes: kprobes, jprobes and kretprobes over ksim's splices.

    probes = Probes(kmgr)
    kp = KProbe("submit_bio", pre_handler=count.atomic_assign(count + 1))
    probes.register_kprobe(kp)
    kmgr.run()
    kp.nhit, kp.nmissed
    probes.unregister_kprobe(kp)

A probe names its place as Linux does (``symbol``, ``symbol`` + ``offset``, or
``address``) and carries up to three handlers.  A handler is either a snippet
(an AST, compiled into the kernel: works on every target) or, on a target that
dispatches traps in-process (unicorn), a Python callable that gets the
registers, readable and writable.

How it is spliced
-----------------
A probe is one entry in the Manager's ledger, like any snippet, so other
snippets at the same point (and re-plans of it) keep it whole.  The *pre*
stage is a snippet at the point (the point's patch: snippets, the probed
instruction relocated, a jump back).  A Python pre handler forces the trap
tactic: the target calls it from its int3 dispatch, before resuming in the
patch.  A *post* handler runs right after the probed instruction: the patch
places the post stage (the post snippet, or an int3 routed to the Python post
handler) between the relocated instruction and the rest.  That is only possible
when the probed instruction falls through, so a post handler on a branch, call
or ret is refused (HandlerUnsupported).

Recursion (kprobes' kprobe_running)
-----------------------------------
One flag in kernel data is shared by every probe of a :class:`Probes`: 0 idle,
1 a handler runs, 2 between a pre handler and its post handler.  A probe hit
while it is not 0 -- a handler calling a probed function -- skips its handlers
and counts as missed; a post stage runs only when its pre stage left 2.  The
toy kernel is uniprocessor; on an SMP kernel the flag is global, not per cpu,
so a hit on another cpu while a handler runs is also counted as missed.

Return probes watch the function's ``ret`` instructions (its exit points), so
recursion and nested probes need no shadow stack: each return runs the handler
with that activation's return value.  A function that leaves by a tail call has
no such exit for its own return and is refused (NoReturnPoint).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, cast

from ksim.analysis.points import Point, PointKind
from ksim.arch.base import Arch, Flow, Insn
from ksim.errors import (
    HandlerUnsupported,
    NoReturnPoint,
    ProbeError,
    ProbeExists,
)
from ksim.kapi import Handle, Manager
from ksim.snippets import ast
from ksim.snippets.check import check as check_snippet

#: a handler: a snippet, or (emulators only) a Python callable
Handler = ast.Node | Callable[..., Any]

IDLE, RUNNING, STEPPING = 0, 1, 2


class Regs:
    """The registers of the interrupted kernel, for a Python handler.

    Registers by the architecture's names (x86-64: ``regs.rdi``, ``regs["rdi"]``);
    assignment writes the register.  The program counter (``regs.ip``, or by its
    name: ``regs.rip``) reads as the probed address; assigning it makes execution
    resume there instead of at the probed instruction (kprobes' "pre handler
    changed ip", the post handler is then skipped)."""

    # declared for the type checker: __getattr__ answers only for register names
    _t: Any
    _m: Any
    _ip: int
    _arch: Arch
    redirect: int | None

    def __init__(self, target: Any, machine: Any, ip: int, arch: Arch) -> None:
        object.__setattr__(self, "_t", target)
        object.__setattr__(self, "_m", machine)
        object.__setattr__(self, "_ip", ip)
        object.__setattr__(self, "_arch", arch)
        object.__setattr__(self, "redirect", None)

    def __getattr__(self, name: str) -> int:
        if name in (self._arch.pc_reg, "ip"):
            return self._ip  # type: ignore[no-any-return]
        return int(self._m.reg(name))

    def __setattr__(self, name: str, value: int) -> None:
        if name in (self._arch.pc_reg, "ip"):
            object.__setattr__(self, "redirect", value)
        else:
            self._m.set_reg(name, value)

    __getitem__ = __getattr__
    __setitem__ = __setattr__

    def arg(self, n: int) -> int:
        """The n-th argument register (valid at a function's entry)."""
        return int(self._m.reg(self._arch.arg_regs[n]))

    def args(self, n: int | None = None) -> tuple[int, ...]:
        """The first ``n`` argument registers (all of them by default)."""
        count = len(self._arch.arg_regs) if n is None else n
        return tuple(self.arg(i) for i in range(count))

    @property
    def retval(self) -> int:
        return int(self._m.reg(self._arch.ret_reg))

    def read(self, address: int, size: int) -> bytes:
        return bytes(self._t.read(address, size))

    def read_u(self, address: int, size: int = 8) -> int:
        return int.from_bytes(self.read(address, size), "little")


@dataclass(eq=False)
class KProbe:
    """Linux's struct kprobe: where, and what to run before and after."""

    symbol: str | None = None
    offset: int = 0
    address: int | None = None
    pre_handler: Handler | None = None
    post_handler: Handler | None = None
    #: fault_handler(probe, regs, exc) -> True when it handled an exception a
    #: Python handler raised (else the exception stops the run and is re-raised)
    fault_handler: Callable[[KProbe, Regs, BaseException], bool] | None = None
    #: the splice policy of a snippet-only probe ("auto", "jmp", "trap")
    splice: str = "auto"
    _probes: Probes | None = field(default=None, repr=False)
    _hits: ast.Var | None = field(default=None, repr=False)
    _missed: ast.Var | None = field(default=None, repr=False)
    _installed: _Installed | None = field(default=None, repr=False)
    #: the counts at unregistering (kprobes keeps nmissed in the struct)
    _final: tuple[int, int] = field(default=(0, 0), repr=False)

    @property
    def registered(self) -> bool:
        return self._probes is not None

    @property
    def nhit(self) -> int:
        """Hits whose handlers ran."""
        return self._count(self._hits, 0)

    @property
    def nmissed(self) -> int:
        """Hits skipped because a probe handler was already running."""
        return self._count(self._missed, 1)

    def _count(self, var: ast.Var | None, which: int) -> int:
        if self._probes is None or var is None:
            return self._final[which]
        return self._probes.kmgr.read(var)


@dataclass(eq=False)
class JProbe:
    """Linux's struct jprobe: ``entry`` sees the function's arguments at its entry.

    A snippet ``entry`` uses ``ast.arg(n)``; a Python ``entry`` is called with
    the first ``nargs`` argument registers as integers."""

    symbol: str | None = None
    entry: Handler | None = None
    nargs: int = 6
    address: int | None = None
    kp: KProbe | None = field(default=None, repr=False)

    @property
    def nhit(self) -> int:
        return self._kp().nhit

    @property
    def nmissed(self) -> int:
        return self._kp().nmissed

    def _kp(self) -> KProbe:
        if self.kp is None:
            raise ProbeError("the jprobe is not registered")
        return self.kp


@dataclass(eq=False)
class KretProbe:
    """Linux's struct kretprobe: ``handler`` runs at every return of the function.

    A snippet handler reads ``ast.retval()``; a Python handler(probe, regs) reads
    ``regs.retval``.  ``entry_handler`` (optional) runs at the entry."""

    symbol: str | None = None
    handler: Handler | None = None
    entry_handler: Handler | None = None
    address: int | None = None
    #: one kprobe per ret of the function; and the entry handler's, if any
    kps: list[KProbe] = field(default_factory=list, repr=False)
    entry_kp: KProbe | None = field(default=None, repr=False)

    @property
    def nhit(self) -> int:
        """Returns whose handler ran."""
        return sum(kp.nhit for kp in self.kps)

    @property
    def nmissed(self) -> int:
        return sum(kp.nmissed for kp in self.kps)


@dataclass
class _Installed:
    """What registering one kprobe put in the kernel, to take out again."""

    point: Point
    handle: Handle


class Probes:
    """The probe registry of one attached kernel (kernel/kprobes.c's core)."""

    def __init__(self, kmgr: Manager) -> None:
        self.kmgr = kmgr
        self.target = kmgr.target
        self.arch = kmgr.arch
        #: kprobe_running: shared by every probe registered here (see module doc)
        self.running = kmgr.malloc(8)
        self._by_address: dict[int, KProbe] = {}
        self._ids = itertools.count(1)

    # --- kprobes --------------------------------------------------------------------
    def register_kprobe(self, kp: KProbe) -> None:
        """Splice ``kp`` in, or raise (NotOnBoundary, Blacklisted, ProbeExists, ...)
        having changed nothing."""
        if kp.registered:
            raise ProbeExists("the probe is already registered")
        address = self.resolve(kp)
        if address in self._by_address:
            raise ProbeExists(f"a probe is already registered at {address:#x}")
        point = self.kmgr.point_at(address)  # NotOnBoundary, OutsideText
        self._check_handlers(kp, point)
        kp._hits, kp._missed = self.kmgr.malloc(8), self.kmgr.malloc(8)
        try:
            kp._installed = self._install(kp, point)
        except BaseException:
            self.kmgr.free(kp._hits)
            self.kmgr.free(kp._missed)
            kp._hits = kp._missed = None
            raise
        kp._probes = self
        kp.address = address
        self._by_address[address] = kp

    def unregister_kprobe(self, kp: KProbe) -> None:
        if kp._probes is not self or kp._installed is None:
            raise ProbeError("the probe is not registered here")
        inst = kp._installed
        self.kmgr.remove_snippet(inst.handle)
        del self._by_address[inst.point.address]
        kp._installed = None
        kp._probes = None
        # the counters live in kernel data: keep their last values in the object
        assert kp._hits is not None and kp._missed is not None
        kp._final = (self.kmgr.read(kp._hits), self.kmgr.read(kp._missed))
        self.kmgr.free(kp._hits)
        self.kmgr.free(kp._missed)
        kp._hits = kp._missed = None

    def register_kprobes(self, kps: Iterable[KProbe]) -> None:
        """All or nothing: every probe's point is dry-run first, so that a refusal
        known then changes nothing (a probe spliced and taken out again leaves its
        patch's bytes in the patch area); on a later failure the probes registered
        so far are unregistered."""
        kps = list(kps)
        addresses: set[int] = set()
        for kp in kps:
            address = self._dry_run(kp)
            if address in addresses:
                raise ProbeExists(f"two probes of the batch are at {address:#x}")
            addresses.add(address)
        done: list[KProbe] = []
        try:
            for kp in kps:
                self.register_kprobe(kp)
                done.append(kp)
        except BaseException:
            for kp in reversed(done):
                self.unregister_kprobe(kp)
            raise

    def unregister_kprobes(self, kps: Iterable[KProbe]) -> None:
        for kp in list(kps):
            self.unregister_kprobe(kp)

    # --- jprobes ----------------------------------------------------------------------
    def register_jprobe(self, jp: JProbe) -> None:
        if jp.entry is None:
            raise ProbeError("a jprobe needs an entry handler")
        entry = jp.entry
        if isinstance(entry, ast.Node):
            pre: Handler = entry
        else:
            nargs = jp.nargs

            def pre(_kp: KProbe, regs: Regs) -> None:
                entry(*regs.args(nargs))

        address = jp.address if jp.address is not None else self._function_address(jp.symbol)
        kp = KProbe(address=address, pre_handler=pre)
        if self.kmgr.point_at(address).kind is not PointKind.ENTRY:
            raise ProbeError(f"a jprobe goes at a function's entry, not {address:#x}")
        self.register_kprobe(kp)
        jp.kp = kp

    def unregister_jprobe(self, jp: JProbe) -> None:
        self.unregister_kprobe(jp._kp())
        jp.kp = None

    # --- kretprobes -------------------------------------------------------------------
    def register_kretprobe(self, rp: KretProbe) -> None:
        if rp.handler is None:
            raise ProbeError("a kretprobe needs a handler")
        address = rp.address if rp.address is not None else self._function_address(rp.symbol)
        func = self.target.image.function_at(address)
        if func is None or func.address != address:
            raise ProbeError(f"a kretprobe goes on a function, {address:#x} is not one's entry")
        exits = self.kmgr.exit_points(func)
        code = self.kmgr.facts.function_code(func)
        for p in exits:
            insn = code.insns[code.index_of(p.address)]
            if insn.flow is not Flow.RET:
                raise NoReturnPoint(f"{func.name} leaves by {insn.mnemonic} at {p.address:#x} "
                                    "(a tail call): its return value is not seen there")
        if not exits:
            raise NoReturnPoint(f"{func.name} never returns")
        kps = [KProbe(address=p.address, pre_handler=rp.handler) for p in exits]
        entry = (KProbe(address=address, pre_handler=rp.entry_handler)
                 if rp.entry_handler is not None else None)
        self.register_kprobes(kps + ([entry] if entry is not None else []))
        rp.kps, rp.entry_kp = kps, entry

    def unregister_kretprobe(self, rp: KretProbe) -> None:
        self.unregister_kprobes(rp.kps + ([rp.entry_kp] if rp.entry_kp is not None else []))
        rp.entry_kp = None

    # --- internals ---------------------------------------------------------------------
    def _dry_run(self, kp: KProbe) -> int:
        """Refuse ``kp`` as register_kprobe would if its point cannot be spliced now;
        else its address."""
        if kp.registered:
            raise ProbeExists("the probe is already registered")
        address = self.resolve(kp)
        if address in self._by_address:
            raise ProbeExists(f"a probe is already registered at {address:#x}")
        point = self.kmgr.point_at(address)
        self._check_handlers(kp, point)
        python = self._python(kp.pre_handler) or self._python(kp.post_handler)
        self.kmgr.check_insert(point, "trap" if python else kp.splice)
        return address

    def resolve(self, kp: KProbe) -> int:
        """The probe's address.  A probe on a function's first byte goes to its entry
        point: past the ftrace location the kernel owns, as Linux moves a probe at
        +0 past the ``endbr64`` (arch_adjust_kprobe_addr, arch/x86/kernel/kprobes/core.c)."""
        if kp.address is not None:
            if kp.symbol is not None:
                raise ProbeError("give a probe a symbol or an address, not both")
            address = kp.address + kp.offset
        elif kp.symbol is None:
            raise ProbeError("a probe needs a symbol or an address")
        else:
            address = self._function_address(kp.symbol) + kp.offset
        func = self.target.image.function_at(address)
        if func is not None and func.address == address:
            return self.kmgr.entry_point(func).address
        return address

    def _function_address(self, symbol: str | None) -> int:
        if symbol is None:
            raise ProbeError("a probe needs a symbol or an address")
        image = self.target.image
        return image.function(symbol).address if image.has_function(symbol) else image.address_of(symbol)

    def _python(self, h: Handler | None) -> bool:
        return h is not None and not isinstance(h, ast.Node)

    def _check_handlers(self, kp: KProbe, point: Point) -> None:
        """Every refusal that does not need the kernel, before anything changes."""
        for h in (kp.pre_handler, kp.post_handler):
            if h is not None and not isinstance(h, ast.Node) and not callable(h):
                raise ProbeError(f"a handler is a snippet or a callable, not {type(h).__name__}")
        if (self._python(kp.pre_handler) or self._python(kp.post_handler)) and \
                not self.target.capabilities.python_hooks:
            raise HandlerUnsupported(f"{self.target.name} cannot call Python at a trap: "
                                     "use snippet handlers")
        if isinstance(kp.pre_handler, ast.Node):
            check_snippet(kp.pre_handler, point.kind)
        if isinstance(kp.post_handler, ast.Node):
            check_snippet(kp.post_handler, PointKind.INSN)
        if kp.post_handler is not None and self._insn(point).flow is not Flow.SEQ:
            insn = self._insn(point)
            raise HandlerUnsupported(f"a post handler needs an instruction that falls through; "
                                     f"{insn.mnemonic} at {insn.address:#x} does not")

    def _insn(self, point: Point) -> Insn:
        code = self.kmgr.facts.function_code(point)
        return code.insns[code.index_of(point.address)]

    def _install(self, kp: KProbe, point: Point) -> _Installed:
        """One entry in the Manager's ledger: the pre stage before the probed
        instruction, the post stage right after it, in the point's one patch."""
        assert kp._hits is not None and kp._missed is not None
        flag, hits, missed = self.running, kp._hits, kp._missed
        post = kp.post_handler is not None
        after = STEPPING if post else IDLE
        python_pre = self._python(kp.pre_handler)
        snippet: ast.Node | None = None
        if not python_pre:
            body = [cast(ast.Node, kp.pre_handler)] if kp.pre_handler is not None else []
            snippet = ast.if_(flag == IDLE,
                              ast.seq(flag.assign(RUNNING), hits.atomic_assign(hits + 1),
                                      *body, flag.assign(after)),
                              missed.atomic_assign(missed + 1))
        post_snippet: ast.Node | None = None
        post_hook = None
        if post and self._python(kp.post_handler):
            post_hook = self._python_post(kp, self._insn(point).end)
        elif post:
            post_snippet = ast.if_(flag == STEPPING,
                                   ast.seq(flag.assign(RUNNING), cast(ast.Node, kp.post_handler),
                                           flag.assign(IDLE)))
        policy = "trap" if python_pre or post_hook is not None else kp.splice
        handle = self.kmgr.insert_snippet(
            point, snippet, splice=policy, post=post_snippet, missed=missed,
            pre_hook=self._python_pre(kp, after) if python_pre else None, post_hook=post_hook)
        return _Installed(point, handle)

    def _python_pre(self, kp: KProbe, after: int) -> Callable[[Any, int], int | None]:
        assert kp._hits is not None and kp._missed is not None
        flag, hits, missed = self.running, kp._hits, kp._missed
        read, write = self.kmgr.read, self.kmgr.write

        def on_trap(machine: Any, site: int) -> int | None:
            if read(flag) != IDLE:
                write(missed, read(missed) + 1)
                return None
            write(hits, read(hits) + 1)
            write(flag, RUNNING)
            regs = Regs(self.target, machine, site, self.arch)
            self._call(kp, kp.pre_handler, regs)
            if regs.redirect is not None:
                write(flag, IDLE)  # the probed instruction (and its post stage) is skipped
                return int(regs.redirect)
            write(flag, after)
            return None

        return on_trap

    def _call(self, kp: KProbe, handler: Any, regs: Regs) -> None:
        try:
            handler(kp, regs)
        except BaseException as exc:
            if kp.fault_handler is not None and kp.fault_handler(kp, regs, exc):
                return
            self.kmgr.write(self.running, IDLE)
            raise

    def _python_post(self, kp: KProbe, after: int) -> Callable[[Any, int], int | None]:
        flag = self.running
        read, write = self.kmgr.read, self.kmgr.write

        def on_trap(machine: Any, site: int) -> int | None:
            if read(flag) != STEPPING:
                return None
            write(flag, RUNNING)
            self._call(kp, kp.post_handler, Regs(self.target, machine, after, self.arch))
            write(flag, IDLE)
            return None

        return on_trap


__all__ = ["HandlerUnsupported", "JProbe", "KProbe", "KretProbe", "NoReturnPoint", "ProbeError",
           "ProbeExists", "Probes", "Regs"]
