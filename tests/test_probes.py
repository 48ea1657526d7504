"""Kprobes-style probes on unicorn:toy and unicorn:toy-arm64, with the behaviours of Linux's lib/test_kprobes.c:
pre and post handlers, batch registration, recursion counted as missed, kretprobe
return values, refusals that change nothing, and 256 probes leaving the text as it was."""

from __future__ import annotations

import pytest
from conftest import TOY_IMAGES, needs_image, toy_name

from ksim.errors import (
    AlreadySpliced,
    HandlerUnsupported,
    NoReturnPoint,
    NotOnBoundary,
    ProbeExists,
)
from ksim.kapi import Manager
from ksim.probes import JProbe, KProbe, KretProbe, Probes
from ksim.snippets import arg, call, retval

ITER = 200


@pytest.fixture(params=TOY_IMAGES)
def m(request):
    needs_image(request.param)
    with Manager.attach(f"unicorn:{request.param}") as mgr:
        yield mgr


def arg_reg(m: Manager, n: int) -> str:
    return m.arch.arg_regs[n]


def text(m: Manager) -> dict[int, bytes]:
    return m.text_snapshot()


def addr(m: Manager, name: str) -> int:
    return m.find_function(name).address


def rets(m: Manager, name: str) -> list[int]:
    return [p.address for p in m.exit_points(name)]


def test_snippet_pre_and_post_both_fire_and_post_sees_pre(m):
    probes = Probes(m)
    seen, posts, last = m.malloc(), m.malloc(), m.malloc()
    kp = KProbe("tcp_sync_mss", pre_handler=seen.assign(arg(1)),
                post_handler=ast_seq(posts.assign(posts + 1), last.assign(seen + 1)))
    probes.register_kprobe(kp)
    pmtus = []
    remove = m.target.machine.hook_code(addr(m, "tcp_sync_mss"),
                                        lambda mach, _a: pmtus.append(mach.reg(arg_reg(m, 1))))
    m.run(iterations=ITER)
    remove()
    assert kp.nhit == m.read(posts) == len(pmtus) > 0
    assert m.read(last) == pmtus[-1] + 1
    assert kp.nmissed == 0
    probes.unregister_kprobe(kp)


def ast_seq(*body):
    from ksim.snippets import seq
    return seq(*body)


def test_python_pre_and_post_handlers_see_and_change_registers(m):
    probes = Probes(m)
    log: list[tuple[str, int]] = []
    pmtu = arg_reg(m, 1)

    def pre(kp, regs):
        log.append(("pre", regs[pmtu]))
        assert regs.ip == regs[m.arch.pc_reg] == kp.address
        regs[pmtu] = 1500  # every call now syncs to an MTU of 1500

    def post(kp, regs):
        log.append(("post", regs[pmtu]))

    kp = KProbe("tcp_sync_mss", pre_handler=pre, post_handler=post)
    probes.register_kprobe(kp)
    mss = []
    removes = [m.target.machine.hook_code(a, lambda mach, _a: mss.append(mach.reg(m.arch.ret_reg)))
               for a in rets(m, "tcp_sync_mss")]
    m.run(iterations=ITER)
    for r in removes:
        r()
    assert kp.nhit == len(mss) > 0
    assert [k for k, _ in log] == ["pre", "post"] * kp.nhit
    assert all(v == 1500 for k, v in log if k == "post")  # post sees what pre wrote
    assert set(mss) == {1500 - 40}
    probes.unregister_kprobe(kp)


def test_batch_registration_is_all_or_nothing(m):
    probes = Probes(m)
    before = text(m)
    good = [KProbe("submit_bio", pre_handler=lambda kp, regs: None),
            KProbe("kmalloc", pre_handler=lambda kp, regs: None)]
    probes.register_kprobes(good)
    with m.oracle(addr(m, "submit_bio")) as o1, m.oracle(addr(m, "kmalloc")) as o2:
        m.run(iterations=ITER)
        assert (good[0].nhit, good[1].nhit) == (o1.count, o2.count)
    assert o1.count > 0 and o2.count > 0
    probes.unregister_kprobes(good)
    assert text(m) == before
    bad = [KProbe("submit_bio", pre_handler=lambda kp, regs: None),
           KProbe("tcp_sync_mss", offset=1, pre_handler=lambda kp, regs: None)]
    heap = m.target._data.allocated()
    with pytest.raises(NotOnBoundary):
        probes.register_kprobes(bad)
    assert not bad[0].registered and text(m) == before and m.splices() == {}
    assert m.target._data.allocated() == heap


def test_a_refused_kretprobe_leaves_even_the_patch_area_as_it_was(m):
    """A later exit of the function inside another splice's window: refused by the
    dry run before any exit is spliced (an exit spliced and taken out again would
    leave its patch's bytes in the patch area, which is text too)."""
    probes = Probes(m)
    exits = rets(m, "fget")
    blocker = None
    for insn in m.facts.function_code(m.entry_point("fget")).insns:
        if insn.address in exits:
            continue
        if m.can_insert(m.point_at(insn.address), "jmp+displace") is not None:
            continue
        hs = m.insert_many([m.point_at(insn.address)], ast_seq(), splice="jmp+displace")
        covered = {a for w in m.patch_of(hs[0]).writes for a in range(w.address, w.end)}
        if any(e in covered for e in exits[1:]):
            blocker = hs
            break
        m.remove_many(hs)
    if blocker is None:
        pytest.skip("no splice of fget covers one of its later exits")
    before = (text(m), m.splices(), m.target._code.allocated(), m.target._data.allocated())
    var = m.malloc()
    with pytest.raises(AlreadySpliced, match="inside bytes another splice overwrote"):
        probes.register_kretprobe(KretProbe("fget", handler=var.atomic_assign(var + 1)))
    m.free(var)
    assert (text(m), m.splices(), m.target._code.allocated(),
            m.target._data.allocated()) == before
    m.remove_many(blocker)


def test_recursive_hit_is_missed_and_handler_runs_once(m):
    probes = Probes(m)
    target = addr(m, "get_jiffies_64")
    ran = m.malloc()
    m.allow_calls(target)
    # the handler calls the probed function: that inner hit must be skipped
    kp = KProbe("get_jiffies_64", pre_handler=ast_seq(ran.assign(ran + 1), call(target)))
    inner: list[int] = []
    other = KProbe("tcp_sync_mss", pre_handler=lambda k, r: inner.append(1))
    probes.register_kprobes([kp, other])
    with m.oracle(target) as o:
        m.run(iterations=ITER)
    assert o.count > 0
    assert kp.nhit == m.read(ran) == kp.nmissed == o.count // 2
    probes.unregister_kprobes([kp, other])


def test_a_probe_hit_inside_another_probes_handler_is_missed(m):
    probes = Probes(m)
    m.allow_calls("get_jiffies_64")
    outer = KProbe("submit_bio", pre_handler=call(addr(m, "get_jiffies_64")))
    inner = KProbe("get_jiffies_64", pre_handler=lambda k, r: None)
    probes.register_kprobes([outer, inner])
    with m.oracle(addr(m, "get_jiffies_64")) as o:
        m.run(iterations=ITER)
    assert outer.nhit > 0
    assert inner.nmissed == outer.nhit
    assert inner.nhit + inner.nmissed == o.count
    probes.unregister_kprobes([outer, inner])


@pytest.mark.parametrize("python", [False, True])
def test_kretprobe_sees_return_values_through_recursion(m, python):
    probes = Probes(m)
    total = m.malloc()
    got: list[int] = []
    handler = ((lambda kp, regs: got.append(regs.retval)) if python
               else total.assign(total + retval()))
    rp = KretProbe("fib", handler=handler)
    probes.register_kretprobe(rp)
    want: list[int] = []
    removes = [m.target.machine.hook_code(a, lambda mach, _a: want.append(mach.reg(m.arch.ret_reg)))
               for a in rets(m, "fib")]
    m.run(iterations=ITER)
    for r in removes:
        r()
    assert rp.nhit == len(want) > 0
    if python:
        assert got == want
    else:
        assert m.read(total) == sum(want) % 2**64
    probes.unregister_kretprobe(rp)


def test_kretprobe_refuses_a_tail_calling_function(m):
    with pytest.raises(NoReturnPoint):
        Probes(m).register_kretprobe(KretProbe("submit_bio", handler=retval()))
    assert m.splices() == {}


def test_jprobe_gets_the_arguments(m):
    probes = Probes(m)
    args: list[tuple[int, int]] = []
    jp = JProbe("tcp_sync_mss", entry=lambda sk, pmtu: args.append((sk, pmtu)), nargs=2)
    probes.register_jprobe(jp)
    want: list[tuple[int, int]] = []
    remove = m.target.machine.hook_code(
        addr(m, "tcp_sync_mss"), lambda mach, _a: want.append((mach.reg(arg_reg(m, 0)), mach.reg(arg_reg(m, 1)))))
    m.run(iterations=ITER)
    remove()
    assert args == want and jp.nhit == len(want) > 0
    probes.unregister_jprobe(jp)


def test_symbol_plus_offset_off_a_boundary_is_refused_and_changes_nothing(m):
    probes = Probes(m)
    before, heap = text(m), m.target._data.allocated()
    kp = KProbe("tcp_sync_mss", offset=1, pre_handler=lambda k, r: None)
    with pytest.raises(NotOnBoundary):
        probes.register_kprobe(kp)
    assert not kp.registered and text(m) == before and m.splices() == {}
    assert m.target._data.allocated() == heap


def test_a_second_probe_at_the_same_address_is_refused(m):
    probes = Probes(m)
    kp = KProbe("kmalloc", pre_handler=lambda k, r: None)
    probes.register_kprobe(kp)
    with pytest.raises(ProbeExists):
        probes.register_kprobe(KProbe("kmalloc", pre_handler=lambda k, r: None))
    with pytest.raises(ProbeExists):
        probes.register_kprobe(kp)
    probes.unregister_kprobe(kp)


def test_post_handler_after_a_branch_is_refused(m):
    ret = rets(m, "tcp_sync_mss")[0]
    with pytest.raises(HandlerUnsupported):
        Probes(m).register_kprobe(KProbe(address=ret, post_handler=lambda k, r: None))
    assert m.splices() == {}


def test_fault_handler_handles_a_failing_handler(m):
    probes = Probes(m)
    faults: list[BaseException] = []

    def boom(kp, regs):
        raise ValueError("handler failed")

    def fault(kp, regs, exc):
        faults.append(exc)
        return True

    kp = KProbe("submit_bio", pre_handler=boom, fault_handler=fault)
    probes.register_kprobe(kp)
    result = m.run(iterations=ITER)
    assert result.checksum is not None and len(faults) == kp.nhit > 0
    probes.unregister_kprobe(kp)
    kp = KProbe("submit_bio", pre_handler=boom)
    probes.register_kprobe(kp)
    with pytest.raises(ValueError):
        m.run(iterations=ITER)
    probes.unregister_kprobe(kp)


def test_256_probes_registered_hit_and_cleared(m):
    probes = Probes(m)
    before = text(m)
    sites: list[int] = []
    for name in ("tcp_sync_mss", "submit_bio", "kmalloc", "kfree", "kmem_cache_alloc",
                 "kmem_cache_free", "vfs_read", "vfs_write", "memcpy", "crc32_le", "schedule",
                 "__alloc_pages", "__free_pages", "tcp_sendmsg", "e100_xmit_frame",
                 "e100_rx_clean", toy_name(m, "do_syscall_64"), "fib", "update_process_times",
                 "scheduler_tick", "run_timer_softirq", "context_switch", "__switch_to"):
        sites += [i.address for i in m.facts.function_code(name).insns]
    sites = sites[:256]
    assert len(sites) == 256
    hits: dict[int, int] = {}

    def pre(kp, regs):
        hits[kp.address] = hits.get(kp.address, 0) + 1

    kps = [KProbe(address=a, pre_handler=pre) for a in sites]
    probes.register_kprobes(kps)
    assert len(m.splices()) == 256
    m.run(iterations=50)
    assert sum(kp.nhit for kp in kps) == sum(hits.values()) > 0
    assert sum(1 for kp in kps if kp.nhit) > 100
    probes.unregister_kprobes(kps)
    assert m.splices() == {} and text(m) == before
    with Manager.attach(m.target.name) as clean:
        assert m.run(iterations=50).checksum == clean.run(iterations=50).checksum
