"""Function and call-site replacement (on unicorn:toy and unicorn:toy-arm64), and
components loaded with relocations, built for each image's architecture
(the relocations themselves: tests/test_component_relocations.py)."""

from __future__ import annotations

import pytest
from conftest import TOY_IMAGES, needs_image

from ksim import components
from ksim.errors import (
    AlreadySpliced,
    LinkError,
    NotOnBoundary,
    ReplacementError,
)
from ksim.kapi import Manager
from ksim.replace import Replacements

ITER = 200


@pytest.fixture(params=TOY_IMAGES)
def m(request):
    needs_image(request.param)
    with Manager.attach(f"unicorn:{request.param}") as mgr:
        yield mgr


@pytest.fixture
def x86(toy_path):
    with Manager.attach("unicorn:toy") as mgr:
        yield mgr


def text(m: Manager) -> dict[int, bytes]:
    return m.text_snapshot()


PID_SOURCE = """
typedef unsigned long u64;
u64 calls;
extern u64 jiffies;
int task_pid_nr_v2(void *task) { calls++; return 1000 + (int)(jiffies & 0); }
"""


@pytest.mark.parametrize("splice", ["trap", "jmp"])
def test_a_short_function_is_replaced_by_a_component_and_undone(m, splice):
    baseline = m.run(iterations=ITER).checksum
    before = text(m)
    patch_area = m.target.read(m.target._code.start, 4096)
    comp = components.load(m, components.build_c(PID_SOURCE, arch=m.arch, name="pid_v2"))
    r = Replacements(m)
    h = r.replace_function("task_pid_nr", comp.symbol("task_pid_nr_v2"), splice=splice)
    if splice == "trap":
        assert h.tactic == "trap" and h.writes[0].new == m.arch.trap
    else:
        assert h.tactic in ("jmp", "jmp+displace", "springboard")
    with m.oracle(m.find_function("task_pid_nr").address) as o:
        m.run(iterations=ITER)
    calls = int.from_bytes(m.copy_from_kernel(comp.symbol("calls"), 8), "little")
    assert calls == o.count > 0
    r.undo(h)
    comp.unload()
    assert text(m) == before
    assert m.target.read(m.target._code.start, 4096) == patch_area
    assert m.run(iterations=ITER).checksum == baseline


def test_replacing_with_a_kernel_function_by_name(m):
    # fib(n) replaced by fib itself is refused; by another int(int) function it runs
    r = Replacements(m)
    with pytest.raises(ReplacementError):
        r.replace_function("fib", "fib")
    before = text(m)
    h = r.replace_function("tcp_sync_mss", "tcp_current_mss", splice="jmp")
    assert h.tactic in ("jmp", "jmp+displace") and text(m) != before
    r.undo(h)
    assert text(m) == before and r.active == {}


def test_refusals_change_nothing(m):
    r = Replacements(m)
    before = text(m)
    entry = m.find_function("tcp_sync_mss").address
    with pytest.raises(NotOnBoundary):
        r.replace_call(entry + 1, "fib")
    with pytest.raises(ReplacementError):
        r.replace_call(entry, "fib")  # not a call
    with pytest.raises(ReplacementError):
        r.replace_function(m.exit_points("tcp_sync_mss")[0].address, "fib")  # not an entry
    code = m.target.read(m.target._code.start, 64)
    with pytest.raises(LinkError):
        components.load(m, components.build_c("extern int no_such_symbol; int f(void) "
                                              "{ return no_such_symbol; }", arch=m.arch,
                                              name="bad"))
    assert m.target.read(m.target._code.start, 64) == code
    assert text(m) == before and r.active == {}


def test_a_replaced_entry_cannot_be_spliced_until_undone(m):
    r = Replacements(m)
    h = r.replace_function("tcp_sync_mss", "tcp_current_mss")
    with pytest.raises(AlreadySpliced):
        r.replace_function("tcp_sync_mss", "fib")
    r.undo(h)
    with pytest.raises(ReplacementError):
        r.undo(h)


def test_component_relocations_link_data_and_kernel_symbols(x86):
    m = x86
    src = """
typedef unsigned long u64;
extern u64 jiffies;
static const u64 table[4] = {1, 2, 3, 4};
u64 counter;
u64 *addr_of_jiffies(void) { return &jiffies; }
u64 pick(u64 i) { counter++; return table[i & 3]; }
"""
    comp = components.load(m, components.build_c(src, name="reloc"))
    insns = list(m.arch.decode(m.target.read(comp.symbol("addr_of_jiffies"), 16),
                               comp.symbol("addr_of_jiffies")))
    # mov rax, imm32 sign-extended (R_X86_64_32S) holds the kernel's jiffies
    assert hex(m.target.image.address_of("jiffies")) in insns[0].op_str
    comp.unload()
    assert not comp.loaded
