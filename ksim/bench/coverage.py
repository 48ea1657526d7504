"""coverage: which share of the points of real kernel code each tactic can splice.

For every function entry, every basic-block start and every instruction boundary
(instructions of blocks that are not alignment padding) of the objects of
:mod:`ksim.bench.corpus`, each tactic of the real planner (``ksim.splice.planner``)
is asked on its own whether it can splice the point — a single 5-byte jmp, a jmp
with displaced instructions, a springboard, a trap — with the planner inputs the
Manager would use (``SiteFacts``: the CFG's branch targets, padding slots, the
blacklist) and a patch area within jmp range.  "auto" is what the Manager's
default policy picks: the first tactic that accepts, in cost order.  Refusals are
counted by reason (addresses and mnemonics taken out so that alike reasons add up).

The snippet is the entry counter, compiled once per object with every register
taken as live (the planner's decisions do not depend on the snippet's bytes; its
length only has to be placement-independent, which the codegen guarantees).
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

from ksim.bench.common import Context, Section, Table, pyplot
from ksim.bench.corpus import CodeSet, all_sets

NAME = "coverage"
TITLE = "Share of points each tactic can splice (real planner)"
TACTICS = ("jmp", "jmp+displace", "springboard", "trap")
KINDS = ("entry", "block", "insn")
AUTO = ("jmp", "jmp+displace", "springboard", "trap")


def normalize(reason: str) -> str:
    r = re.sub(r"0x[0-9a-fA-F]+", "ADDR", reason)
    r = re.sub(r"cannot displace \S+( \S+)? at", "cannot displace an instruction at", r)
    r = re.sub(r"ksim\.errors\.", "", r)
    r = re.sub(r"\b(is|of|outside) \S+ \(ADDR\.\.ADDR\)", r"\1 FUNC", r)
    r = re.sub(r"(past the end of|inside|of) [A-Za-z_][\w.]*", r"\1 FUNC", r)
    return r


class Coverage:
    def __init__(self, cs: CodeSet) -> None:
        from ksim.arch import get_arch
        from ksim.core import KernelABI, MemRef
        from ksim.snippets import ast
        from ksim.splice.sites import SiteFacts

        self.cs = cs
        self.arch = get_arch(cs.image.arch)
        self.facts = SiteFacts(cs.image, self.arch)
        text_end = max(end for _s, end in cs.image.text_regions)
        #: a patch area right after the text: within jmp range of every point
        self.area = (text_end + 0x100000) & ~0xFFF
        counter = ast.Var(self.area + 0x80000, 8)
        abi = KernelABI(current_task=MemRef(self.area + 0x80008, None, 8), task_pid_offset=0,
                        cpu_number=MemRef(self.area + 0x80010, None, 4))
        code = self.arch.compile_snippets([counter.atomic_assign(counter + 1)], self.area,
                                          live=self.arch.all_regs, abi=abi, point_kind="entry")
        self.snippet_code = code

    def compile_at(self, address: int) -> bytes:
        return self.snippet_code

    def points(self, func: Any) -> dict[str, list[int]]:
        from ksim.analysis.points import is_padding

        fa = self.facts.analysis(func)
        insns = [i.address for b in fa.cfg.blocks.values() if b.insns and not is_padding(b, self.arch)
                 for i in b.insns]
        return {"entry": [self.facts.entry(func).address], "block": list(fa.points.blocks),
                "insn": insns}

    def ask(self, func: Any, point: int) -> dict[str, str | None]:
        """tactic -> None when it can splice the point, else its (normalized) reason."""
        from ksim.errors import KsimError
        from ksim.splice import planner

        fc = self.facts.function_code(func)
        req = self.facts.request(point, fc, self.compile_at, self.area)
        try:
            planner.check_point(self.arch, req)
        except KsimError as exc:
            return {t: normalize(f"{type(exc).__name__}: {exc}") for t in TACTICS}
        out: dict[str, str | None] = {}
        for t in TACTICS:
            try:
                result = planner.TACTICS[t](self.arch, req)
            except KsimError as exc:
                result = f"{type(exc).__name__}: {exc}"
            out[t] = None if not isinstance(result, str) else normalize(result)
        return out


def measure(cs: CodeSet, limit: int | None, bar: Any = None) -> dict[str, Any]:
    cov = Coverage(cs)
    counts: dict[str, Counter[str]] = {k: Counter() for k in KINDS}
    refusals: dict[str, dict[str, Counter[str]]] = {k: {t: Counter() for t in TACTICS} for k in KINDS}
    totals: Counter[str] = Counter()
    failed_funcs = 0
    todo: list[tuple[Any, dict[str, list[int]]]] = []
    for func in cs.functions:
        try:
            todo.append((func, cov.points(func)))
        except Exception:  # noqa: BLE001 - an unanalysable function is counted, not fatal
            failed_funcs += 1
    # every entry and block; instruction boundaries sampled evenly when limited
    all_insns = sum(len(p["insn"]) for _f, p in todo)
    stride = max(1, all_insns // limit) if limit else 1
    seen = 0
    for func, pts in todo:
        insn_pts = []
        for a in pts["insn"]:
            if seen % stride == 0:
                insn_pts.append(a)
            seen += 1
        for kind, addrs in (("entry", pts["entry"]), ("block", pts["block"]), ("insn", insn_pts)):
            for a in addrs:
                answer = cov.ask(func, a)
                totals[kind] += 1
                for t in TACTICS:
                    why = answer[t]
                    if why is None:
                        counts[kind][t] += 1
                    else:
                        refusals[kind][t][why] += 1
                if answer["jmp"] is None or answer["jmp+displace"] is None:
                    counts[kind]["any jmp"] += 1
                chosen = next((t for t in AUTO if answer[t] is None), "none")
                counts[kind]["auto:" + chosen] += 1
        if bar is not None:
            bar.advance(note=cs.name)
    return {
        "functions": len(cs.functions),
        "functions_not_analysed": failed_funcs,
        "insn_stride": stride,
        "points": dict(totals),
        "can_splice": {k: dict(counts[k]) for k in KINDS},
        "share": {k: {t: counts[k][t] / totals[k] if totals[k] else None
                      for t in (*TACTICS, "any jmp")} for k in KINDS},
        "auto": {k: {t: counts[k]["auto:" + t] / totals[k] if totals[k] else None
                     for t in (*AUTO, "none")} for k in KINDS},
        "refusals": {k: {t: dict(refusals[k][t].most_common()) for t in TACTICS} for k in KINDS},
        "patch_area": cov.area,
    }


def run(ctx: Context) -> Section:
    sets, notes = all_sets(ctx)
    limit = ctx.pick(None, 4000, 150)
    if ctx.smoke:
        for cs in sets:
            cs.functions = cs.functions[:12]
    out: dict[str, Any] = {}
    with ctx.bar(sum(len(cs.functions) for cs in sets), "coverage") as bar:
        for cs in sets:
            out[cs.name] = measure(cs, limit, bar)
    rows = []
    for name, r in out.items():
        for kind in KINDS:
            s, a = r["share"][kind], r["auto"][kind]
            rows.append([name, kind, r["points"].get(kind, 0)]
                        + [_pct(s[t]) for t in (*TACTICS, "any jmp")]
                        + [_pct(a[t]) for t in (*AUTO, "none")])
    table = Table("Share of points (%) each tactic can splice alone, and what 'auto' picks",
                  ["object", "points", "n", "jmp", "jmp+disp", "springb.", "trap", "any jmp",
                   "auto:jmp", "auto:disp", "auto:sb", "auto:trap", "none"], rows)
    reasons: Counter[tuple[str, str]] = Counter()
    for r in out.values():
        for t in TACTICS:
            for why, n in r["refusals"]["insn"][t].items():
                reasons[(t, why)] += n
    top = Table("Most frequent refusals at instruction boundaries (all objects)",
                ["tactic", "reason", "count"],
                [[t, why[:90], n] for (t, why), n in reasons.most_common(14)])
    if limit:
        notes.append(f"{ctx.mode} run: instruction boundaries sampled evenly, about {limit} per "
                     "object (entries and block starts: all)")
    if ctx.smoke:
        notes.append("smoke run: the first 12 functions of each object")
    notes.append("'jmp' replaces one instruction of >= 5 bytes; 'jmp+disp' displaces the "
                 "following instructions of a shorter one; shares are of all points")
    return Section(out, [table, top], notes, {"insn_limit": limit})


def _pct(v: float | None) -> float | None:
    return None if v is None else round(100 * v, 1)


def plot(section: dict[str, Any], path: str) -> None:
    plt = pyplot()
    res = section["results"]
    names = list(res)
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.6), sharey=True)
    colors = {"jmp": "#1f77b4", "jmp+displace": "#2ca02c", "springboard": "#ff7f0e",
              "trap": "#d62728", "none": "#7f7f7f"}
    for ax, kind in zip(axes, KINDS, strict=False):
        left = [0.0] * len(names)
        for t in (*AUTO, "none"):
            vals = [100 * (res[n]["auto"][kind][t] or 0) for n in names]
            ax.barh(names, vals, left=left, color=colors[t], label=t)
            left = [a + b for a, b in zip(left, vals, strict=False)]
        ax.set_title(f"{kind} points: tactic ksim picks")
        ax.set_xlim(0, 100)
        ax.set_xlabel("% of points")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=5, fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.92))
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
