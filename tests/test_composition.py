"""Random compositions of every way ksim changes text, on unicorn:toy.

A hypothesis state machine inserts and removes snippets, registers and
unregisters kprobes (with post handlers, some in Python) and kretprobes, and
replaces and restores functions, at random and overlapping points of a few
functions.  After every run each counter equals the address-hook oracle for its
address; every refused operation leaves text, trap routes, hooks and
allocations as they were; and once everything is removed the text is
byte-identical to the original and no route, hook or allocation is left.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)

from ksim.errors import KsimError
from ksim.kapi import Manager
from ksim.probes import KProbe, KretProbe, Probes
from ksim.replace import Replacements
from ksim.snippets import ast

ITER = 40
FUNCS = ("tcp_sync_mss", "tcp_current_mss", "vfs_read", "fget", "ramfs_name_hash", "bio_put")
#: replacements with the same signature: (original, replacement)
SWAPS = (("tcp_sync_mss", "tcp_current_mss"), ("vfs_write", "vfs_read"), ("bio_put", "bio_endio"))
POLICIES = ("auto", "jmp", "trap")


def _state(m: Manager) -> dict[str, Any]:
    t = m.target
    return {"text": m.text_snapshot(), "routes": dict(t._traps),
            "hooks": {s: list(f) for s, f in t._trap_hooks.items()},
            "code": t._code.allocated(), "data": t._data.allocated(), "splices": m.splices()}


class Composition(RuleBasedStateMachine):
    snippets = Bundle("snippets")
    kprobes = Bundle("kprobes")
    kretprobes = Bundle("kretprobes")
    replacements = Bundle("replacements")
    batches = Bundle("batches")

    def __init__(self) -> None:
        super().__init__()
        self.m = Manager.attach("unicorn:toy")
        self.original = self.m.text_snapshot()
        self.idle = _state(self.m)
        self.probes = Probes(self.m)
        self.replace = Replacements(self.m)
        self.addresses = sorted({i.address for f in FUNCS
                                 for i in self.m.facts.function_code(self.m.entry_point(f)).insns})
        #: counters to check after a run: (var, address whose executions it counts)
        self.counters: dict[int, tuple[ast.Var, int]] = {}
        self.posts: dict[int, ast.Var] = {}

    def attempt(self, op: Any) -> Any:
        """Run ``op``; a refusal must change nothing."""
        before = _state(self.m)
        try:
            return op()
        except KsimError:
            assert _state(self.m) == before
            return None

    # --- snippets --------------------------------------------------------------------
    @rule(target=snippets, i=st.integers(0, 10**6), policy=st.sampled_from(POLICIES))
    def insert(self, i: int, policy: str) -> Any:
        address = self.addresses[i % len(self.addresses)]
        var = self.m.malloc()
        h = self.attempt(lambda: self.m.insert_snippet(self.m.point_at(address),
                                                       var.atomic_assign(var + 1), splice=policy))
        if h is None:
            self.m.free(var)
            return None
        self.counters[id(h)] = (var, address)
        return h

    @rule(h=consumes(snippets))
    def remove(self, h: Any) -> None:
        if h is None:
            return
        self.m.remove_snippet(h)
        var, _ = self.counters.pop(id(h))
        self.m.free(var)

    @rule(target=batches, picks=st.lists(st.integers(0, 10**6), min_size=1, max_size=12),
          policy=st.sampled_from(POLICIES))
    def insert_batch(self, picks: list[int], policy: str) -> Any:
        addresses = sorted({self.addresses[i % len(self.addresses)] for i in picks})
        points = [self.m.point_at(a) for a in addresses]
        counters = {a: self.m.malloc() for a in addresses}
        hs = self.attempt(lambda: self.m.insert_many(
            points, lambda p: counters[p.address].atomic_assign(counters[p.address] + 1),
            splice=policy))
        if hs is None:
            for var in counters.values():
                self.m.free(var)
            return None
        for h in hs:
            self.counters[id(h)] = (counters[h.point.address], h.point.address)
        return hs

    @rule(hs=consumes(batches))
    def remove_batch(self, hs: Any) -> None:
        if hs is None:
            return
        self.m.remove_many(hs)
        for h in hs:
            var, _ = self.counters.pop(id(h))
            self.m.free(var)

    # --- kprobes -----------------------------------------------------------------------
    @rule(target=kprobes, i=st.integers(0, 10**6), post=st.sampled_from(["none", "snippet", "python"]))
    def register(self, i: int, post: str) -> Any:
        address = self.addresses[i % len(self.addresses)]
        posts = self.m.malloc()

        def count_post(_kp: Any, _regs: Any) -> None:
            self.m.write(posts, self.m.read(posts) + 1)

        handler = {"none": None, "snippet": posts.atomic_assign(posts + 1),
                   "python": count_post}[post]
        kp = KProbe(address=address, post_handler=handler)
        if self.attempt(lambda: self.probes.register_kprobe(kp)) is None and not kp.registered:
            self.m.free(posts)
            return None
        if post != "none":
            self.posts[id(kp)] = posts
        else:
            self.m.free(posts)
        return kp

    @rule(kp=consumes(kprobes))
    def unregister(self, kp: Any) -> None:
        if kp is None:
            return
        self.probes.unregister_kprobe(kp)
        posts = self.posts.pop(id(kp), None)
        if posts is not None:
            self.m.free(posts)

    @rule(target=kretprobes, f=st.sampled_from(FUNCS))
    def register_ret(self, f: str) -> Any:
        rets = self.m.malloc()
        rp = KretProbe(f, handler=rets.atomic_assign(rets + 1))
        if self.attempt(lambda: self.probes.register_kretprobe(rp)) is None and not rp.kps:
            self.m.free(rets)
            return None
        self.counters[id(rp)] = (rets, -1)
        return rp

    @rule(rp=consumes(kretprobes))
    def unregister_ret(self, rp: Any) -> None:
        if rp is None:
            return
        self.probes.unregister_kretprobe(rp)
        var, _ = self.counters.pop(id(rp))
        self.m.free(var)

    # --- replacements ------------------------------------------------------------------
    @rule(target=replacements, swap=st.sampled_from(SWAPS), policy=st.sampled_from(POLICIES))
    def replace_function(self, swap: tuple[str, str], policy: str) -> Any:
        return self.attempt(lambda: self.replace.replace_function(*swap, splice=policy))

    @rule(r=consumes(replacements))
    def restore(self, r: Any) -> None:
        if r is not None:
            self.replace.undo(r)

    # --- running -------------------------------------------------------------------------
    @precondition(lambda self: bool(self.counters or self.probes._by_address))
    @rule()
    def run_and_check(self) -> None:
        m = self.m
        kps = list(self.probes._by_address.values())
        watched = {a for _, a in self.counters.values() if a >= 0} | {kp.address for kp in kps}
        before = {k: m.read(v) for k, (v, _) in self.counters.items()}
        hits = {id(kp): (kp.nhit, kp.nmissed) for kp in kps}
        posts = {k: m.read(v) for k, v in self.posts.items()}
        oracles = {a: m.target.oracle_counter(a) for a in watched}
        try:
            m.run(iterations=ITER)
        finally:
            for o in oracles.values():
                o.close()
        for k, (var, address) in self.counters.items():
            if address >= 0:
                assert m.read(var) - before[k] == oracles[address].count, hex(address)
        for kp in kps:
            nhit, nmissed = kp.nhit - hits[id(kp)][0], kp.nmissed - hits[id(kp)][1]
            assert nhit + nmissed == oracles[kp.address].count, hex(kp.address)
            if id(kp) in self.posts:  # a post stage runs after every hit whose pre stage ran
                assert m.read(self.posts[id(kp)]) - posts[id(kp)] == nhit, hex(kp.address)

    @invariant()
    def text_is_the_original_outside_the_ledger(self) -> None:
        code = self.m.target._code
        for start, data in self.m.text_snapshot().items():
            now, orig = bytearray(data), self.original[start]
            lo, hi = max(code.start, start) - start, min(code.end, start + len(now)) - start
            if lo < hi:  # the patch area's contents are the patches'
                now[lo:hi] = orig[lo:hi]
            for a in self.m._owners:
                if start <= a < start + len(now):
                    now[a - start] = orig[a - start]
            assert bytes(now) == orig

    def teardown(self) -> None:
        try:
            for r in list(self.replace.active.values()):
                self.replace.undo(r)
            for kp in list(self.probes._by_address.values()):
                self.probes.unregister_kprobe(kp)
            for splice in list(self.m._splices.values()):
                for h in list(splice.handles):
                    self.m.remove_snippet(h)
            for var, _ in self.counters.values():
                self.m.free(var)
            for var in self.posts.values():
                self.m.free(var)
            assert self.m.text_snapshot() == self.original
            assert self.m.target._traps == {} and self.m.target._trap_hooks == {}
            assert self.m.target._code.allocated() == {}
            left = self.m.target._data.allocated()
            left.pop(self.probes.running.address, None)
            left.pop(self.m.guard.address, None)
            assert left == {}
        finally:
            self.m.detach()


Composition.TestCase.settings = settings(
    max_examples=40, stateful_step_count=16, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestComposition = Composition.TestCase
