"""sizes: the instruction-length distribution of real kernel code (the paper's Fig. 4).

For each object: the share of 1..15-byte instructions (linear sweep of each
function's bytes without its trailing padding), the share of instructions of
5 bytes or more (the paper found at most 30 % in Linux 2.4.20), and the lengths of
the first instruction of each function — where an entry probe goes.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from ksim.arch import get_arch
from ksim.arch.base import Arch, Flow, Insn
from ksim.bench.common import Context, Section, Table, pyplot, save
from ksim.bench.corpus import PAPER_NAMES, CodeSet, all_sets

NAME = "sizes"
TITLE = "Instruction lengths in kernel code (paper Fig. 4)"
MAX_LEN = 15


#: what makes an instruction 5 bytes or longer: a rel32 branch or call, a REX prefix
_REL32_FLOWS = frozenset({Flow.CALL, Flow.JMP, Flow.JCC})


def measure(cs: CodeSet, limit: int | None = None) -> dict[str, Any]:
    lengths: Counter[int] = Counter()
    first: Counter[int] = Counter()
    fentry = 0
    long_kinds: Counter[str] = Counter()
    funcs = cs.functions[:limit] if limit else cs.functions
    arch = get_arch(cs.image.arch)
    for func in funcs:
        code = cs.code(func)
        if not code:
            continue
        insns = list(arch.decode(code, func.address))
        sizes = [i.size for i in insns]
        if not sizes:
            continue
        for i in insns:
            if i.size >= 5:
                long_kinds["all"] += 1
                long_kinds["rel32"] += i.flow in _REL32_FLOWS
                long_kinds["rex"] += _has_rex(i.raw)
        lengths.update(sizes)
        first[sizes[0]] += 1
        if _fentry_site(arch, insns[0]):
            fentry += 1
    total = sum(lengths.values()) or 1
    nfuncs = sum(first.values()) or 1
    return {
        "functions": sum(first.values()),
        "instructions": sum(lengths.values()),
        "bytes": sum(k * v for k, v in lengths.items()),
        "length_counts": {str(n): lengths.get(n, 0) for n in range(1, MAX_LEN + 1)},
        "length_share": {str(n): lengths.get(n, 0) / total for n in range(1, MAX_LEN + 1)},
        "share_ge5": sum(v for k, v in lengths.items() if k >= 5) / total,
        "share_ge2_lt5": sum(v for k, v in lengths.items() if 2 <= k < 5) / total,
        "share_1": lengths.get(1, 0) / total,
        "mean_length": sum(k * v for k, v in lengths.items()) / total,
        "first_counts": {str(n): first.get(n, 0) for n in range(1, MAX_LEN + 1)},
        "first_ge5": sum(v for k, v in first.items() if k >= 5) / nfuncs,
        "first_fentry": fentry / nfuncs,
        #: of the instructions of >= 5 bytes: direct calls/jumps with rel32, and REX-prefixed
        "ge5_rel32_branch_share": long_kinds["rel32"] / (long_kinds["all"] or 1),
        "ge5_rex_share": long_kinds["rex"] / (long_kinds["all"] or 1),
        "method": cs.method,
    }


def _fentry_site(arch: Arch, insn: Insn) -> bool:
    """Whether a function's first instruction is its ftrace site: a jump-sized
    direct call (call __fentry__, x86-64's e8 rel32) or the nop of that size the
    kernel turns it into at boot."""
    return insn.size == arch.jmp_size and (insn.flow is Flow.CALL or arch.is_filler(insn))


def _has_rex(raw: bytes) -> bool:
    """A REX prefix (40-4f) after any legacy prefixes (SDM vol. 2, 2.2.1)."""
    for b in raw:
        if b in (0x66, 0x67, 0xF0, 0xF2, 0xF3, 0x2E, 0x36, 0x3E, 0x26, 0x64, 0x65):
            continue
        return 0x40 <= b <= 0x4F
    return False


def run(ctx: Context) -> Section:
    sets, notes = all_sets(ctx)
    limit = ctx.pick(None, None, 25)
    out: dict[str, Any] = {}
    with ctx.bar(len(sets), "sizes") as bar:
        for cs in sets:
            out[cs.name] = measure(cs, limit)
            bar.advance(note=cs.name)
    rows = [[name, PAPER_NAMES.get(name, "-"), r["functions"], r["instructions"],
             round(100 * r["share_1"], 1), round(100 * r["share_ge2_lt5"], 1),
             round(100 * r["share_ge5"], 1), round(r["mean_length"], 2),
             round(100 * r["first_ge5"], 1), round(100 * r["first_fentry"], 1),
             round(100 * r["ge5_rel32_branch_share"], 1), round(100 * r["ge5_rex_share"], 1)]
            for name, r in out.items()]
    table = Table("Instruction lengths (shares in %)",
                  ["object", "paper", "functions", "insns", "1 B", "2-4 B", ">=5 B", "mean B",
                   "first>=5", "fentry", ">=5: rel32", ">=5: REX"], rows)
    dist = Table("Share of each length (%)", ["object"] + [str(n) for n in range(1, 12)] + ["12+"],
                 [[name] + [round(100 * r["length_share"][str(n)], 1) for n in range(1, 12)]
                  + [round(100 * sum(r["length_share"][str(n)] for n in range(12, MAX_LEN + 1)), 1)]
                  for name, r in out.items()])
    if limit:
        notes.append(f"smoke run: the first {limit} functions of each object")
    notes.append("first>=5: functions whose first instruction is 5 bytes or longer; "
                 "fentry: ... that is the 5-byte call __fentry__ (a nop once booted); "
                 ">=5: rel32 / REX: of the instructions of 5 bytes or more, the share of direct "
                 "calls and jumps with a 32-bit displacement, and of REX-prefixed ones")
    return Section(out, [table, dist], notes, {"limit": limit})


def plot(section: dict[str, Any], path: str) -> None:
    plt = pyplot()
    res = section["results"]
    names = list(res)
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 4.6), gridspec_kw={"width_ratios": [3, 1.3]})
    width = 0.8 / max(len(names), 1)
    xs = list(range(1, 12))
    for i, name in enumerate(names):
        shares = [100 * res[name]["length_share"][str(n)] for n in xs]
        ax.bar([x - 0.4 + (i + 0.5) * width for x in xs], shares, width, label=name)
    ax.axvline(4.5, color="k", lw=0.8, ls="--")
    ax.text(4.6, ax.get_ylim()[1] * 0.92, "a 5-byte jmp fits", fontsize=8)
    ax.set_xticks(xs)
    ax.set_xlabel("instruction length (bytes)")
    ax.set_ylabel("share of instructions (%)")
    ax.set_title("Instruction-length distribution (cf. paper Fig. 4)")
    ax.legend(fontsize=8)
    ge5 = [100 * res[n]["share_ge5"] for n in names]
    first = [100 * res[n]["first_ge5"] for n in names]
    ys = range(len(names))
    ax2.barh([y + 0.2 for y in ys], ge5, 0.4, label="all instructions >= 5 B")
    ax2.barh([y - 0.2 for y in ys], first, 0.4, label="first instruction >= 5 B")
    ax2.axvline(30, color="r", lw=0.8, ls="--")
    ax2.text(31, len(names) - 0.6, "paper: max 30%", fontsize=8, color="r")
    ax2.set_yticks(list(ys))
    ax2.set_yticklabels(names, fontsize=8)
    ax2.set_xlim(0, 105)
    ax2.set_xlabel("% of instructions")
    ax2.legend(fontsize=7, loc="lower right")
    save(fig, path)
