"""Basic blocks and control-flow graph of one function, with jump-table recovery.

The function's bytes are decoded by linear sweep (compilers put no data inside
kernel functions; padding is nops or int3).  Blocks start at the entry, at every
direct branch target inside the function, at every jump-table target, and after
every instruction that transfers control (jmp, jcc, call, ret, stop).  Calls end
blocks: their return site is a block reached by a ``call-return`` edge.

Blocks partition the function's bytes exactly: padding and code no edge reaches
(after the last ret, after a call that never returns) are blocks too, with
``reachable`` False, and bytes that do not decode form a final block with no
instructions (``data`` True).

Jump tables are recovered in the shapes compilers give a switch statement: an
indirect jump through a table entry indexed by a register (or through a register
loaded from one), with the number of entries taken from a dominating unsigned
bound check on the index, found by walking back through blocks with a single
predecessor.  Which instructions read a table, check a bound or copy the index
is the architecture's to say (``Arch.jump_tables``, e.g.
``ksim.arch.x86_64.jumptables``); the walk is generic.  An indirect jump without
such a bound is not a table (see ``unresolved``).
"""

from __future__ import annotations

import bisect
import enum
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from ksim.arch import DEFAULT_ARCH, get_arch
from ksim.arch.base import Arch, Flow, Insn, JumpTableIdioms
from ksim.errors import KsimError

_MAX_TABLE = 4096  # entries; a larger bound is not a switch statement


class EdgeKind(enum.StrEnum):
    FALLTHROUGH = "fallthrough"   # block ends because the next one starts here
    JUMP = "jump"                 # unconditional direct jmp
    TAKEN = "taken"               # jcc taken
    NOT_TAKEN = "not-taken"       # jcc not taken
    TABLE = "table"               # indirect jmp through a recovered jump table
    CALL_RETURN = "call-return"   # from a call to its return site


@dataclass(frozen=True, slots=True)
class Edge:
    src: int   # start of the source block
    dst: int   # start of the destination block
    kind: EdgeKind


@dataclass(slots=True)
class Block:
    start: int
    end: int
    insns: tuple[Insn, ...]
    succs: list[int] = field(default_factory=list)
    preds: list[int] = field(default_factory=list)
    #: some path from the function's entry reaches this block
    reachable: bool = True
    #: bytes that do not decode (no instructions)
    data: bool = False

    @property
    def size(self) -> int:
        return self.end - self.start

    @property
    def last(self) -> Insn | None:
        return self.insns[-1] if self.insns else None

    def __contains__(self, address: object) -> bool:
        return isinstance(address, int) and self.start <= address < self.end


@dataclass(frozen=True, slots=True)
class JumpTable:
    jump: int                    # address of the indirect jmp
    table: int                   # address of the table
    index_reg: str               # register holding the index
    entries: tuple[int, ...]     # targets in table order (with repeats)

    @property
    def targets(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.entries)))


@dataclass
class CFG:
    start: int
    end: int
    insns: tuple[Insn, ...]
    blocks: dict[int, Block]          # by start address, in address order
    edges: tuple[Edge, ...]
    tables: dict[int, JumpTable]      # by address of the jmp
    #: indirect jmps that are not recovered jump tables
    unresolved: tuple[int, ...]
    #: direct branch targets inside the function that are not instruction starts
    misaligned: tuple[int, ...]

    def block_at(self, address: int) -> Block | None:
        """The block containing ``address``."""
        starts = list(self.blocks)
        i = bisect.bisect_right(starts, address) - 1
        if i >= 0 and address in self.blocks[starts[i]]:
            return self.blocks[starts[i]]
        return None


#: reads ``size`` bytes of the image at ``address`` (raises KsimError when it cannot)
ImageReader = Callable[[int, int], bytes]


def build_cfg(insns: Sequence[Insn], start: int, end: int, read: ImageReader | None = None, *,
              tables: Mapping[int, JumpTable] | None = None, arch: Arch | None = None) -> CFG:
    """The CFG of the function ``[start, end)`` whose linear-sweep decode is ``insns``.

    ``tables``, when given, are the function's jump tables (by address of their jmp),
    recovered before: they are used as they are, and no more are looked for.
    Otherwise, given ``read``, jump tables are recovered the way ``arch`` (the
    instructions' architecture; ``ksim.arch.DEFAULT_ARCH`` when not given) lays
    them out.
    """
    insns = tuple(insns)
    by_addr = {i.address: i for i in insns}
    known = tables is not None
    table: dict[int, JumpTable] = dict(tables or {})
    idioms = (arch or get_arch(DEFAULT_ARCH)).jump_tables if read and not known else None
    # Tables add leaders, which split blocks, which can expose more guards: iterate.
    for _ in range(4):
        blocks, edges = _blocks(insns, by_addr, start, end, table)
        _mark_reachable(blocks, start)
        found = _recover_tables(idioms, blocks, by_addr, start, end, read, table) if idioms and read else {}
        if not found:
            break
        table.update(found)
    unresolved = tuple(i.address for i in insns if i.flow is Flow.JMP_INDIRECT and i.address not in table)
    misaligned = tuple(sorted({
        i.target for i in insns
        if i.flow in (Flow.JMP, Flow.JCC) and i.target is not None
        and start <= i.target < end and i.target not in by_addr
    }))
    _mark_reachable(blocks, start)
    return CFG(start, end, insns, blocks, tuple(edges), table, unresolved, misaligned)


# --- blocks and edges ---------------------------------------------------------------
_ENDS_BLOCK = frozenset({Flow.JMP, Flow.JCC, Flow.JMP_INDIRECT, Flow.CALL, Flow.CALL_INDIRECT,
                         Flow.RET, Flow.STOP})


def _leaders(insns: tuple[Insn, ...], by_addr: dict[int, Insn], start: int, end: int,
             tables: dict[int, JumpTable]) -> set[int]:
    leaders = {start}
    for insn in insns:
        if insn.flow in _ENDS_BLOCK and insn.end < end:
            leaders.add(insn.end)
        if insn.flow in (Flow.JMP, Flow.JCC) and insn.target in by_addr:
            leaders.add(insn.target)
    for table in tables.values():
        leaders.update(table.targets)
    if insns and insns[-1].end < end:
        leaders.add(insns[-1].end)  # undecodable tail
    return leaders


def _blocks(insns: tuple[Insn, ...], by_addr: dict[int, Insn], start: int, end: int,
            tables: dict[int, JumpTable]) -> tuple[dict[int, Block], list[Edge]]:
    leaders = sorted(_leaders(insns, by_addr, start, end, tables))
    blocks: dict[int, Block] = {}
    pos = 0
    for n, lead in enumerate(leaders):
        stop = leaders[n + 1] if n + 1 < len(leaders) else end
        body = []
        while pos < len(insns) and insns[pos].address < stop:
            body.append(insns[pos])
            pos += 1
        blocks[lead] = Block(lead, stop, tuple(body), data=not body)
    edges: list[Edge] = []
    for block in blocks.values():
        for dst, kind in _out_edges(block, blocks, tables):
            edges.append(Edge(block.start, dst, kind))
            if dst not in block.succs:
                block.succs.append(dst)
                blocks[dst].preds.append(block.start)
    return blocks, edges


def _out_edges(block: Block, blocks: dict[int, Block],
               tables: dict[int, JumpTable]) -> Iterator[tuple[int, EdgeKind]]:
    last = block.last
    if last is None:
        return
    nxt = block.end if block.end in blocks else None
    flow = last.flow
    if flow is Flow.SEQ:
        if nxt is not None:
            yield nxt, EdgeKind.FALLTHROUGH
    elif flow is Flow.JMP:
        if last.target in blocks:
            yield last.target, EdgeKind.JUMP
    elif flow is Flow.JCC:
        if last.target in blocks:
            yield last.target, EdgeKind.TAKEN
        if nxt is not None:
            yield nxt, EdgeKind.NOT_TAKEN
    elif flow in (Flow.CALL, Flow.CALL_INDIRECT):
        if nxt is not None:
            yield nxt, EdgeKind.CALL_RETURN
    elif flow is Flow.JMP_INDIRECT and last.address in tables:
        for target in tables[last.address].targets:
            yield target, EdgeKind.TABLE


def _mark_reachable(blocks: dict[int, Block], start: int) -> None:
    seen = {start}
    work = [start]
    while work:
        for succ in blocks[work.pop()].succs:
            if succ not in seen:
                seen.add(succ)
                work.append(succ)
    for block in blocks.values():
        block.reachable = block.start in seen


# --- jump tables ----------------------------------------------------------------------
def _walk_back(blocks: dict[int, Block], block: Block, pos: int
               ) -> Iterator[tuple[Insn, Block, int] | tuple[None, Block, EdgeKind]]:
    """Instructions before ``block.insns[pos]``, backwards, along single-predecessor
    blocks.  At each block boundary yields (None, predecessor, edge kind)."""
    seen = {block.start}
    while True:
        for i in range(pos - 1, -1, -1):
            yield block.insns[i], block, i
        # padding before an aligned label falls through into it without being code
        # any path runs: only reachable predecessors count
        preds = [p for p in block.preds if blocks[p].reachable]
        if len(preds) != 1:
            return
        pred = blocks[preds[0]]
        if pred.start in seen or pred.last is None:
            return
        seen.add(pred.start)
        last = pred.last
        if last.flow is Flow.JCC:
            if last.target == block.start and pred.end == block.start:
                return  # both edges reach us: no information
            kind = EdgeKind.TAKEN if last.target == block.start else EdgeKind.NOT_TAKEN
        else:
            kind = EdgeKind.FALLTHROUGH
        yield None, pred, kind
        block, pos = pred, len(pred.insns)


def _find_bound(idioms: JumpTableIdioms, blocks: dict[int, Block], block: Block, pos: int,
                reg: str) -> int | None:
    """Entries allowed by an unsigned bound check that dominates ``block.insns[pos]``
    for the index in ``reg`` (None if there is none).

    Walking backwards, ``index`` maps the registers that carry the index's value
    at the current point to how many low bits of them it is (None: all).  A guard
    (a compare with N and an unsigned branch, ``idioms.bound_check``) on the path
    counts once its compared register is shown to carry the same value: compilers
    often copy the index (x86-64: ``mov eax, esi``, ``movzx eax, al``) before
    comparing the original (``cmp esi, 10``, ``cmp al, 0x20``), so the compared
    registers are tracked backwards from the compare as well, until the two meet.
    """
    index: dict[str, int | None] = {reg: None}
    # (compare address, compared registers once past it, register, width, entries)
    pending: list[tuple[int, dict[str, int | None] | None, str, int | None, int]] = []
    for insn, where, extra in _walk_back(blocks, block, pos):
        if insn is None:
            if extra in (EdgeKind.TAKEN, EdgeKind.NOT_TAKEN):
                check = idioms.bound_check(where.insns, extra is EdgeKind.TAKEN)
                if check is not None and 0 <= check.limit < _MAX_TABLE:
                    pending.append((check.address, None, check.reg, check.bits, check.entries))
            continue
        if insn.flow in (Flow.CALL, Flow.CALL_INDIRECT):
            return None  # the call may change any of them
        _step_back(idioms, index, insn)
        if not index:
            return None
        for k, (cmp_addr, compared, creg, width, count) in enumerate(pending):
            if compared is None and insn.address == cmp_addr:
                compared = {creg: width}
            elif compared is not None:
                _step_back(idioms, compared, insn)
            pending[k] = (cmp_addr, compared, creg, width, count)
            for r, w in (compared or {}).items():
                # the bound holds if it was checked on all the bits the index uses
                if r in index and (w is None or index[r] == w):
                    return count
    return None


def _narrower(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else min(a, b)


def _step_back(idioms: JumpTableIdioms, regs: dict[str, int | None], insn: Insn) -> None:
    """Update ``regs`` (registers holding one value after ``insn``, with the number
    of low bits that hold it) to the point before ``insn``."""
    for reg in [r for r in regs if r in insn.writes]:
        bits = regs.pop(reg)
        src = idioms.copy_source(insn, reg)
        if src is not None:
            regs[src[0]] = _narrower(bits, src[1])


def _recover_tables(idioms: JumpTableIdioms, blocks: dict[int, Block], by_addr: dict[int, Insn],
                    start: int, end: int, read: ImageReader,
                    known: dict[int, JumpTable]) -> dict[int, JumpTable]:
    found: dict[int, JumpTable] = {}
    for block in blocks.values():
        jmp = block.last
        if jmp is None or jmp.flow is not Flow.JMP_INDIRECT or jmp.address in known:
            continue
        table = _table_for(idioms, blocks, block, jmp, by_addr, start, end, read)
        if table is not None:
            found[jmp.address] = table
    return found


def _table_for(idioms: JumpTableIdioms, blocks: dict[int, Block], block: Block, jmp: Insn,
               by_addr: dict[int, Insn], start: int, end: int, read: ImageReader) -> JumpTable | None:
    pos = len(block.insns) - 1
    load = idioms.table_read(jmp)
    where, at = block, pos
    if load is None:
        # a jump through a register: find the load of that register from the table
        target_reg = idioms.jump_reg(jmp)
        if target_reg is None:
            return None
        for insn, blk, extra in _walk_back(blocks, block, pos):
            if insn is None:
                continue
            if insn.flow in (Flow.CALL, Flow.CALL_INDIRECT):
                return None
            if target_reg in insn.writes:
                load = idioms.table_read(insn)
                if load is None or load.dest != target_reg:
                    return None
                assert isinstance(extra, int)
                where, at = blk, extra
                break
        if load is None:
            return None
    count = _find_bound(idioms, blocks, where, at, load.index)
    if count is None or count == 0:
        return None
    try:
        raw = read(load.table, load.entry_size * count)
    except KsimError:
        return None
    entries = idioms.table_targets(load, raw)
    if len(entries) != count or not all(start <= e < end and e in by_addr for e in entries):
        return None
    return JumpTable(jmp.address, load.table, load.index, entries)
