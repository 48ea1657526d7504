"""Basic blocks, CFG edges, jump tables, points and the call graph."""

from __future__ import annotations

import pytest
from analysis_kernel import TABLE_FUNCTIONS, fixture_kernel, kernels

from ksim.analysis import EdgeKind, PointKind, analyze, build_cfg, call_graph, callees
from ksim.arch.base import Flow
from ksim.arch.x86_64.reader import decode
from ksim.errors import ImageError, NotOnBoundary, OutsideText
from ksim.image import Image, load_image

BASE = 0xFFFFFFFF81000000


@pytest.fixture(scope="module", params=kernels(), ids=lambda p: p.rsplit("/", 1)[-1])
def image(request: pytest.FixtureRequest) -> Image:
    return load_image(request.param)


def test_blocks_partition_bytes(image: Image) -> None:
    for func in image.functions:
        a = analyze(image, func)
        cursor = func.address
        for block in a.blocks:
            assert block.start == cursor, func.name
            if block.insns:
                assert block.insns[0].address == block.start
                for x, y in zip(block.insns, block.insns[1:], strict=False):
                    assert x.end == y.address
                assert block.insns[-1].end == block.end
            else:
                assert block.data and block.size > 0
            cursor = block.end
        assert cursor == func.end, func.name
        assert sum(b.size for b in a.blocks) == func.size


def test_branch_targets_are_block_starts(image: Image) -> None:
    for func in image.functions:
        a = analyze(image, func)
        starts = {b.start for b in a.blocks}
        for insn in a.insns:
            if insn.flow in (Flow.JMP, Flow.JCC) and insn.target in func:
                assert insn.target in starts, f"{func.name}: {insn}"
        assert not a.cfg.misaligned


def test_edges_agree_with_successors(image: Image) -> None:
    for func in image.functions:
        a = analyze(image, func)
        by_start = {b.start: b for b in a.blocks}
        for edge in a.edges:
            assert edge.dst in by_start[edge.src].succs
            assert edge.src in by_start[edge.dst].preds
        for block in a.blocks:
            last = block.last
            kinds = {e.kind for e in a.edges if e.src == block.start}
            if last is None:
                continue
            if last.flow is Flow.JCC and last.target in func and block.end < func.end:
                assert kinds == {EdgeKind.TAKEN, EdgeKind.NOT_TAKEN} or last.target == block.end
            if last.flow is Flow.RET or last.flow is Flow.STOP:
                assert not block.succs
            if last.flow is Flow.CALL and block.end < func.end:
                assert kinds == {EdgeKind.CALL_RETURN}


def test_rets_are_exits_and_calls_are_callsites(image: Image) -> None:
    for func in image.functions:
        a = analyze(image, func)
        exits = set(a.points.exits)
        calls = {i.address for i in a.insns if i.flow in (Flow.CALL, Flow.CALL_INDIRECT)}
        for insn in a.insns:
            if insn.flow is Flow.RET:
                assert insn.address in exits
            if insn.flow is Flow.JMP and insn.target not in func:
                assert insn.address in exits  # tail call
        assert set(a.points.callsites) == calls
        assert a.points.entry == func.address
        assert set(a.points.blocks) <= {b.start for b in a.blocks}
        assert all(a.is_boundary(p) for p in [*exits, *calls, *a.points.blocks])


def test_callees_match_call_instructions(image: Image) -> None:
    for func in image.functions:
        expected = set()
        for insn in decode(image.code(func), func.address):
            if insn.flow is Flow.CALL:
                target = image.function_at(insn.target)
                if target is not None and target.address == insn.target:
                    expected.add(target.name)
        assert {f.name for f in callees(image, func)} == expected, func.name


def test_indirect_jumps_of_table_shape_are_recovered(image: Image) -> None:
    """Every jmp through an indexed 8-byte table gcc emitted is recovered as a table."""
    for func in image.functions:
        a = analyze(image, func)
        for insn in a.insns:
            if insn.flow is Flow.JMP_INDIRECT and "*8" in insn.op_str:
                assert insn.address in a.tables, f"{func.name}: {insn}"


@pytest.mark.parametrize("name", TABLE_FUNCTIONS)
def test_fixture_jump_tables(name: str) -> None:
    image = load_image(fixture_kernel())
    a = analyze(image, name)
    assert len(a.tables) == 1 and not a.cfg.unresolved
    table = next(iter(a.tables.values()))
    assert len(table.entries) == 9 and table.index_reg == "rdi"
    assert all(t in {b.start for b in a.blocks} for t in table.targets)
    table_edges = [e for e in a.edges if e.kind is EdgeKind.TABLE]
    assert {e.dst for e in table_edges} == set(table.targets)
    # every case is reachable through the table; the table jmp is not an exit
    assert all(a.block_at(t).reachable for t in table.targets)
    assert table.jump not in a.points.exits
    assert len(a.points.exits) == len([i for i in a.insns if i.flow is Flow.RET])


def test_fixture_points_and_tail_call() -> None:
    image = load_image(fixture_kernel())
    a = analyze(image, "tail_caller")
    tail = [i for i in a.insns if i.flow is Flow.JMP and i.target == image.address_of("add3")]
    assert tail and tail[0].address in a.points.exits
    assert {p.kind for p in a.all_points(insns=True)} == set(PointKind)
    assert [f.name for f in a.callees] == ["note"]


def test_lookup_errors() -> None:
    image = load_image(fixture_kernel())
    a = analyze(image, "keeps")
    assert a.insn_at(a.function.address).address == a.function.address
    with pytest.raises(NotOnBoundary):
        a.insn_at(a.function.address + 1)
    with pytest.raises(OutsideText):
        a.insn_at(a.function.end)
    assert analyze(image, "keeps") is a  # cached


def test_call_graph() -> None:
    image = load_image(fixture_kernel())
    graph = call_graph(image)
    assert {"classify", "classify_reg", "classify_notrack", "keeps", "checked"} <= graph.callees("_start")
    assert graph.callers("add3") == {"keeps"}
    assert graph.tail_calls["tail_caller"] == {"add3"}
    assert graph.indirect["indirect_caller"] == 1
    assert "add3" in graph.reachable_from("_start")


def _table_bytes(entries: list[int]) -> bytes:
    return b"".join(e.to_bytes(8, "little") for e in entries)


def test_guard_taken_form_and_unbounded_jump() -> None:
    """``cmp $2,%edi; jbe L`` guarding the table on the taken edge (annotated hex)."""
    code = bytes.fromhex(
        "83 ff 02"               # +0  cmp $2,%edi
        "76 06"                  # +3  jbe +0xb
        "b8 ff ff ff ff"         # +5  mov $-1,%eax
        "c3"                     # +a  ret
        "89 ff"                  # +b  mov %edi,%edi
        "ff 24 fd 00 10 00 81"   # +d  jmp *0xffffffff81001000(,%rdi,8)
        "b8 01 00 00 00 c3"      # +14 case 0
        "b8 02 00 00 00 c3"      # +1a case 1
        "b8 03 00 00 00 c3"      # +20 case 2
    )
    table_addr = 0xFFFFFFFF81001000
    entries = [BASE + 0x14, BASE + 0x1A, BASE + 0x20]

    def read(addr: int, size: int) -> bytes:
        if addr != table_addr:
            raise ImageError("outside")
        return _table_bytes(entries)[:size]

    insns = list(decode(code, BASE))
    cfg = build_cfg(insns, BASE, BASE + len(code), read)
    table = cfg.tables[BASE + 0xD]
    assert list(table.entries) == entries
    # without the guard there is no bound: the jump stays unresolved
    unguarded = code[:3] + bytes.fromhex("90 90") + code[5:]
    cfg = build_cfg(list(decode(unguarded, BASE)), BASE, BASE + len(code), read)
    assert not cfg.tables and cfg.unresolved == (BASE + 0xD,)


def test_undecodable_tail_is_a_data_block() -> None:
    code = bytes.fromhex("31 c0 c3 06 06")  # xor; ret; two invalid bytes
    cfg = build_cfg(list(decode(code, BASE)), BASE, BASE + len(code))
    blocks = list(cfg.blocks.values())
    assert [(b.start - BASE, b.end - BASE, b.data) for b in blocks] == [(0, 3, False), (3, 5, True)]
    assert not blocks[1].reachable


TABLE_AT = 0xFFFFFFFF81001000
CASES = "dflt: mov eax, -1; ret; c0: mov eax, 1; ret; c1: mov eax, 2; ret; c2: mov eax, 3; ret"
JMP_T = "qword ptr [{r}*8 - 0x7efff000]"  # TABLE_AT, sign-extended


@pytest.mark.parametrize("guard,recovered", [
    ("cmp rdi, 2; ja dflt; jmp " + JMP_T.format(r="rdi"), True),                  # 64-bit compare
    ("mov eax, esi; cmp esi, 2; ja dflt; jmp " + JMP_T.format(r="rax"), True),    # copy, then compare
    ("cmp sil, 2; ja dflt; movzx eax, sil; jmp " + JMP_T.format(r="rax"), True),  # narrow, zero-extended
    ("cmp edi, 3; jae dflt; mov edi, edi; mov rax, " + JMP_T.format(r="rdi") + "; jmp rax", True),
    ("cmp sil, 2; ja dflt; jmp " + JMP_T.format(r="rsi"), False),   # upper bits never checked
    ("cmp edi, 2; ja dflt; mov edi, edx; jmp " + JMP_T.format(r="rdi"), False),  # index replaced
    ("cmp edi, 2; jg dflt; jmp " + JMP_T.format(r="rdi"), False),   # signed: negative indexes pass
    ("cmp edi, 2; ja dflt; call dflt; jmp " + JMP_T.format(r="rdi"), False),  # a call in between
])
def test_guard_forms(guard: str, recovered: bool) -> None:
    import keystone

    ks = keystone.Ks(keystone.KS_ARCH_X86, keystone.KS_MODE_64)
    code = bytes(ks.asm(f"{guard}; {CASES}", BASE)[0])
    insns = list(decode(code, BASE))
    cases = [i.address for i in insns if i.mnemonic == "mov" and i.op_str in ("eax, 1", "eax, 2", "eax, 3")]

    def read(addr: int, size: int) -> bytes:
        if addr != TABLE_AT:
            raise ImageError("outside")
        return _table_bytes(cases)[:size]

    cfg = build_cfg(insns, BASE, BASE + len(code), read)
    jump = next(i for i in insns if i.flow is Flow.JMP_INDIRECT)
    if recovered:
        assert list(cfg.tables[jump.address].entries) == cases
    else:
        assert not cfg.tables and cfg.unresolved == (jump.address,)


# --- the compact analysis (the whole-kernel pass and its store) -------------------------------
def _one_function_image(code: bytes, name: str = "f") -> Image:
    from ksim.image import Section, Symbol

    text = Section(".text", BASE, len(code), True, False, code)
    return Image("<bytes>", "x86_64", "vmlinux", [text], [Symbol(name, BASE, len(code), "func", "vmlinux")])


def _compact_agrees(image: Image, func) -> None:
    from ksim.analysis.abi import support_for
    from ksim.analysis.compact import cfg_of, compute

    support = support_for(image.arch)
    comp = compute(image, support, func)
    insns = list(decode(image.code(func), func.address))
    cfg = build_cfg(insns, func.address, func.end, image.read)
    points = analyze(image, func).points
    assert comp.blocks == len(cfg.blocks), func.name
    assert (comp.exits, comp.block_points, comp.callsites) == (points.exits, points.blocks, points.callsites)
    rebuilt, rcfg = cfg_of(support, image, func, comp)
    assert rebuilt == insns and rcfg.blocks == cfg.blocks and rcfg.edges == cfg.edges, func.name
    assert comp.own_writes == frozenset().union(*(i.writes for i in insns)), func.name


def test_compact_analysis_agrees_with_the_cfg(image: Image) -> None:
    for func in image.functions:
        _compact_agrees(image, func)


def test_sweep_agrees_with_the_compact_analysis(image: Image) -> None:
    from ksim.analysis.abi import support_for
    from ksim.analysis.compact import compute
    from ksim.analysis.sweep import sweep

    support = support_for(image.arch)
    rows, sizes, codes, targets, _tail = sweep(image, support, image.functions)
    at = 0
    for func, row in zip(image.functions, rows, strict=True):
        comp = compute(image, support, func)
        assert (row.blocks, tuple(row.exits), tuple(row.block_points), tuple(row.callsites)) == (
            comp.blocks, comp.exits, comp.block_points, comp.callsites), func.name
        assert (row.own_writes, row.worst, row.calls_out, row.jumps_out, row.tables) == (
            comp.own_writes, comp.worst, comp.calls_out, comp.jumps_out, comp.tables), func.name
        assert sizes[at:at + row.instructions] == comp.sizes
        at += row.instructions
    assert at == len(sizes) == len(codes)


@pytest.mark.parametrize("hexcode,points", [
    # ret, then padding no path reaches: one block point, four blocks
    ("c3 cc cc cc", [0]),
    # a call that does not return, then padding: the first int3 is reached (call-return)
    ("e8 00 00 00 00 cc cc cc", [0, 5]),
    # a jump into the padding reaches that int3 alone
    ("74 03 c3 cc cc cc", [0, 2, 5]),
    # nop filler after a jmp is no point; the code after it is
    ("eb 02 66 90 c3 cc", [0, 4]),
    # filler alone at the entry is reached
    ("90 eb fe cc", [0, 1]),
    # bytes that do not decode end the function: a block with no point
    ("31 c0 06 06", [0]),
    # an instruction ending in 0xcc is not padding
    ("b8 cc cc cc cc c3", [0]),
])
def test_compact_padding_and_filler(hexcode: str, points: list[int]) -> None:
    image = _one_function_image(bytes.fromhex(hexcode))
    func = image.functions[0]
    _compact_agrees(image, func)
    assert list(analyze(image, func).points.blocks) == [BASE + p for p in points]


def test_scan_follows_the_packing_analysis_documents() -> None:
    from ksim.analysis import abi
    from ksim.arch.x86_64 import scan

    assert (scan.FLOWS, scan.FILLER_BIT, scan.TARGET_BIT, scan.EFFECT_SHIFT) == (
        abi.FLOWS, abi.FILLER_BIT, abi.TARGET_BIT, abi.EFFECT_SHIFT)
    assert abi.FLOW_MASK + 1 >= len(abi.FLOWS)
