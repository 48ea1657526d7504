"""census: the sites of real kernel code that splicing could break, and what ksim does with them.

For each kernel object (the Debian vmlinux, e100.ko, ext4.ko, the toy kernel) the
census lists the families of instructions that a careless splice changes:

* ``indirect_call`` — ``call`` through a register or memory (paravirt calls through
  ``pv_ops`` among them): moved as a real call, its callee would return into the
  patch.  ksim moves them as ``push <original return address>; jmp <operand>``.
* ``warn``, ``bug``, ``extable``, ``ftrace``, ``jump_label``, ``static_call`` — the
  kernel finds or rewrites these by address (``ksim.image.tables``): never moved.
  On arm64 a WARN/BUG site is a ``BRK #0x800``, and an ftrace location is the pair
  of its patchable entry (``mov x9, x30`` once the kernel booted, then the nop that
  becomes ``bl ftrace_caller``): both instructions are sites.
* arm64 only: ``branch_prot`` — a BTI landing pad or a pointer-authentication check
  (``autiasp``, ``retaa`` ...), which the kerninst module refuses (BRANCH_PROT);
  ``exclusive`` — an instruction after a load-exclusive up to its store-exclusive
  (EXCLUSIVE, kprobes' ``is_probed_address_atomic``): never moved either.

On arm64 the planner is asked with the hazards the kerninst module adds on a
running kernel from the instructions' bytes (``branch_prot``; ``ARM64_BTI_KERNEL``
is off in Debian's config, so ``paciasp`` is no landing pad), besides the image's
tables, as the Manager asks on the live testbed.

Per site it asks the real planner, with the inputs the Manager uses (``SiteFacts``):

* **at the site**: may the site itself be spliced (policy ``auto``)?  Indirect calls
  should be spliced; table sites refused with their own error.
* **moved**: is the site moved into a patch, by a splice at the site or by any
  jmp-family plan at an instruction just before it (within a 5-byte window)?
  Counted twice: as ksim plans now, and with the hazard rules switched off
  (``FunctionCode.hazards`` emptied: what the planner did before it knew these
  tables).  "moved now" must be zero for every table family; indirect calls are
  moved, safely (the callee returns to the text).

Beside it, coverage: the share of function entries and basic-block starts that a
jmp-family tactic (jmp, jmp+displace, springboard) splices, with the rules and
without them, so that what the refusals cost is measured in the same run.
"""

from __future__ import annotations

import dataclasses
import random
from collections import Counter
from collections.abc import Iterator
from typing import Any

from ksim.bench.common import Context, Section, Table, pyplot
from ksim.bench.corpus import CodeSet

NAME = "census"
TITLE = "Sites splicing could break in real kernel code: how many, refused, moved safely"
FAMILIES = ("indirect_call", "warn", "bug", "extable", "ftrace", "jump_label", "static_call",
            "branch_prot", "exclusive")
#: the families of instructions the kernel needs where they are (never moved)
HAZARD_FAMILIES = FAMILIES[1:]
JMP_FAMILY = ("jmp", "jmp+displace", "springboard")
#: the name of Debian's arm64 vmlinux among the census's objects
ARM64_VMLINUX = "vmlinux (arm64)"


class Census:
    """The planner's answers over one image (the Manager's inputs, a patch area in reach)."""

    def __init__(self, image: Any) -> None:
        from ksim.arch import get_arch
        from ksim.splice.sites import SiteFacts

        self.image = image
        self.arch = get_arch(image.arch)
        # the planner before the hazard rules: no exclusive sequences either
        self.bare_arch = _WithoutExclusives(self.arch)
        ask = branch_prot_hazards(image) if image.arch == "aarch64" else None
        self.facts = SiteFacts(image, self.arch, ask=ask)
        text_end = max(end for _s, end in image.text_regions)
        self.area = (text_end + 0x100000) & ~0xFFF
        # the planner's decisions do not depend on the snippet's bytes: any one
        # instruction will do
        self.snippet = self.arch.trap

    # --- the sites ------------------------------------------------------------------
    def sites(self, family: str) -> list[int]:
        if family == "indirect_call":
            return list(self._indirect_calls())
        if family in ("branch_prot", "exclusive"):
            if self.image.arch != "aarch64":
                return []
            return list(self._branch_prot() if family == "branch_prot" else self._exclusives())
        from ksim.image.tables import TextRef

        return list(self.image.tables.addresses(TextRef(family)))

    def _indirect_calls(self) -> Iterator[int]:
        from ksim.analysis.abi import support_for
        from ksim.arch.base import Flow

        flows = support_for(self.image.arch).flows
        for func in self.image.functions:
            try:
                code = self.image.code(func)
            except Exception:  # noqa: BLE001 - a symbol without bytes (kallsyms-only)
                continue
            for address, _size, flow, _target in flows(code, func.address):
                if flow is Flow.CALL_INDIRECT:
                    yield address

    def _words(self) -> Iterator[tuple[Any, int, int]]:
        """(function, address, instruction word) of every function's code (AArch64)."""
        for func in self.image.functions:
            try:
                code = self.image.code(func)
            except Exception:  # noqa: BLE001 - a symbol without bytes
                continue
            for k in range(0, len(code) - 3, 4):
                yield func, func.address + k, int.from_bytes(code[k:k + 4], "little")

    def _branch_prot(self) -> Iterator[int]:
        for _func, address, word in self._words():
            if is_branch_prot(word):
                yield address

    def _exclusives(self) -> Iterator[int]:
        """The instructions the planner finds inside an exclusive sequence, in the
        functions that have a load-exclusive."""
        funcs = {func for func, _a, word in self._words() if word & 0x3FC00000 == 0x08400000}
        for func in sorted(funcs, key=lambda f: f.address):
            try:
                insns = self.facts.function_code(func).insns
            except Exception:  # noqa: BLE001 - an unanalysable function
                continue
            for index, insn in enumerate(insns):
                if self.arch.in_exclusive_sequence(insns, index):
                    yield insn.address

    # --- the questions ----------------------------------------------------------------
    def code(self, address: int, *, rules: bool) -> Any:
        code = self.facts.function_code(self.facts.point_at(address))
        return code if rules else dataclasses.replace(code, hazards={})

    def request(self, code: Any, point: int, policy: str) -> Any:
        return self.facts.request(point, code, lambda _at: self.snippet, self.area, policy=policy)

    def at_site(self, address: int, *, rules: bool = True) -> str:
        """The tactic "auto" picks at the site, or the refusal's error class."""
        from ksim.errors import KsimError
        from ksim.splice import planner

        try:
            code = self.code(address, rules=rules)
            arch = self.arch if rules else self.bare_arch
            return "spliced:" + planner.plan(arch, self.request(code, address, "auto")).tactic
        except KsimError as exc:
            return "refused:" + type(exc).__name__

    def moved_by_neighbour(self, address: int, *, rules: bool) -> bool:
        """Does a jmp-family plan at an instruction up to 4 bytes before ``address``
        overwrite (and so move) the instruction at ``address``?"""
        from ksim.errors import KsimError
        from ksim.splice import planner

        try:
            code = self.code(address, rules=rules)
        except KsimError:
            return False
        arch = self.arch if rules else self.bare_arch
        for insn in code.insns:
            if not address - self.arch.jmp_size < insn.address < address:
                continue
            req = self.request(code, insn.address, "auto")
            try:
                planner.check_point(arch, req)
            except KsimError:
                continue
            for tactic in JMP_FAMILY:
                try:
                    patch = planner.TACTICS[tactic](arch, req)
                except KsimError:
                    continue
                if not isinstance(patch, str) and any(
                        w.address <= address < w.end for w in patch.writes):
                    return True
        return False

    def jmp_coverage(self, func: Any, *, rules: bool) -> tuple[int, int, int, int]:
        """(entries spliceable, entries, block starts spliceable, block starts) by jmp-family."""
        from ksim.analysis.points import PointKind
        from ksim.errors import KsimError
        from ksim.splice import planner

        fa = self.facts.analysis(func)
        code = self.facts.function_code(func)
        if rules:
            entry = self.facts.entry(func).address
            blocks = [p.address for p in self.facts.points(func, PointKind.BLOCK)]
        else:  # without the rules the entry was the function's first byte
            code = dataclasses.replace(code, hazards={})
            entry, blocks = fa.points.entry, list(fa.points.blocks)
        counts = [0, 0, 0, 0]
        for slot, points in ((0, [entry]), (2, blocks)):
            for point in points:
                counts[slot + 1] += 1
                try:
                    planner.plan(self.arch if rules else self.bare_arch,
                                 self.request(code, point, "jmp"))
                    counts[slot] += 1
                except KsimError:
                    pass
        return counts[0], counts[1], counts[2], counts[3]


class _WithoutExclusives:
    """The architecture as the planner saw it before it knew exclusive sequences."""

    def __init__(self, arch: Any) -> None:
        self._arch = arch

    def __getattr__(self, name: str) -> Any:
        return getattr(self._arch, name)

    def in_exclusive_sequence(self, insns: Any, index: int) -> bool:
        return False


def is_branch_prot(word: int, *, bti_kernel: bool = False) -> bool:
    """The kerninst module's BRANCH_PROT test of an instruction word (ki_branch_prot,
    kmod/kerninst.c): BTI, the AUT* hints, RETAA/RETAB, and PACIASP/PACIBSP when the
    kernel is built for BTI (an implicit landing pad then)."""
    if word & 0xFFFFFBFF == 0xD65F0BFF:  # RETAA, RETAB
        return True
    if word & 0xFFFFF01F != 0xD503201F:  # not a hint
        return False
    op = (word >> 5) & 0x7F
    return op in (0x20, 0x22, 0x24, 0x26, 0x0C, 0x0E, 0x1C, 0x1D, 0x1E, 0x1F) or (
        bti_kernel and op in (0x19, 0x1B))


def branch_prot_hazards(image: Any) -> Any:
    """What the kerninst module answers from the bytes of arm64 text (BRANCH_PROT),
    read from the image: the Manager's question on the live kernel, as a HazardQuery."""
    def ask(ranges: Any) -> list[frozenset[str]]:
        out = []
        for address, length in ranges:
            start = address & ~3
            data = image.read(start, (address + length - start + 3) & ~3)
            found = any(is_branch_prot(int.from_bytes(data[k:k + 4], "little"))
                        for k in range(0, len(data) - 3, 4))
            out.append(frozenset({"branch_prot"}) if found else frozenset())
        return out
    return ask


def measure(name: str, image: Any, per_family: int | None, functions: int | None,
            seed: int = 1, bar: Any = None) -> dict[str, Any]:
    census = Census(image)
    rng = random.Random(seed)
    families: dict[str, Any] = {}
    for family in FAMILIES:
        sites = census.sites(family)
        sample = sites if per_family is None or len(sites) <= per_family else sorted(
            rng.sample(sites, per_family))
        verdicts: Counter[str] = Counter()
        moved_now = moved_before = unanalysed = 0
        examples: list[str] = []
        for address in sample:
            try:
                census.facts.point_at(address)
            except Exception:  # noqa: BLE001 - an unanalysable function: counted, not fatal
                unanalysed += 1
                continue
            verdict = census.at_site(address, rules=True)
            verdicts[verdict] += 1
            if verdict.startswith("spliced:") or census.moved_by_neighbour(address, rules=True):
                moved_now += 1
                examples.append(_where(image, address))
            if census.at_site(address, rules=False).startswith("spliced:") or \
                    census.moved_by_neighbour(address, rules=False):
                moved_before += 1
        families[family] = {
            "sites": len(sites), "examined": len(sample) - unanalysed, "unanalysed": unanalysed,
            "at_site": dict(verdicts.most_common()),
            "refused_at_site": sum(n for v, n in verdicts.items() if v.startswith("refused:")),
            "spliced_at_site": sum(n for v, n in verdicts.items() if v.startswith("spliced:")),
            # moved into a patch, by a splice at the site or by a neighbour's window
            "moved_now": moved_now,
            "moved_without_rules": moved_before,
            "moved_now_examples": examples[:10],
        }
        if bar is not None:
            bar.advance(note=f"{name} {family}")
    funcs = list(image.functions)
    if functions is not None and len(funcs) > functions:
        funcs = rng.sample(funcs, functions)
    cov = {True: [0, 0, 0, 0], False: [0, 0, 0, 0]}
    for func in funcs:
        for rules in (True, False):
            try:
                got = census.jmp_coverage(func, rules=rules)
            except Exception:  # noqa: BLE001 - an unanalysable function: left out of both
                break
            cov[rules] = [a + b for a, b in zip(cov[rules], got, strict=True)]
    coverage = {
        label: {"entry": _share(c[0], c[1]), "block": _share(c[2], c[3]),
                "entries": c[1], "blocks": c[3]}
        for label, c in (("with_rules", cov[True]), ("without_rules", cov[False]))}
    out: dict[str, Any] = {"arch": image.arch, "families": families, "jmp_coverage": coverage,
                           "functions_sampled": len(funcs)}
    if image.arch == "aarch64":
        ftrace = set(census.sites("ftrace"))
        out["ftrace_pairs"] = sum(1 for a in ftrace if a + 4 in ftrace and a - 4 not in ftrace)
    return out


def _where(image: Any, address: int) -> str:
    func = image.function_at(address)
    return f"{func.name}+{address - func.address:#x}" if func else f"{address:#x}"


def _share(n: int, d: int) -> float | None:
    return n / d if d else None


def images(ctx: Context) -> tuple[list[CodeSet], list[str]]:
    """Whole objects: the Debian vmlinux, e100.ko and ext4.ko, and the toy kernel."""
    from ksim.bench import kernel as kmod
    from ksim.bench.corpus import toy_set
    from ksim.image import load_image, load_kallsyms

    notes: list[str] = []
    out: list[CodeSet] = []
    try:
        if ctx.smoke and not kmod.is_cached():
            raise kmod.KernelUnavailable("smoke run: the Debian kernel is not in the cache")
        k = kmod.debian_kernel()
        vmlinux = load_kallsyms(k.kallsyms, k.vmlinux)
        for label, image in (("vmlinux", vmlinux), ("e100.ko", load_image(k.e100)),
                             ("ext4.ko", load_image(k.ext4))):
            out.append(CodeSet(label, image, list(image.functions), "whole object"))
        notes.append(f"Debian kernel {k.abi} ({k.deb.name})")
    except kmod.KernelUnavailable as exc:
        notes.append(f"Debian kernel objects left out: {exc}")
    try:
        if ctx.smoke:
            raise kmod.KernelUnavailable("smoke run: the arm64 kernel is left out")
        a = kmod.debian_kernel(arch="arm64")
        image = a.load()
        out.append(CodeSet(ARM64_VMLINUX, image, list(image.functions), "whole object"))
        notes.append(f"Debian arm64 kernel {a.abi} ({a.deb.name}): the flat Image with its own "
                     "kallsyms and the tables found in it; ARM64_BTI_KERNEL is off in its config")
    except kmod.KernelUnavailable as exc:
        notes.append(f"Debian arm64 vmlinux left out: {exc}")
    out.append(toy_set())
    return out, notes


def run(ctx: Context) -> Section:
    sets, notes = images(ctx)
    per_family = ctx.pick(3000, 400, 25)
    functions = ctx.pick(3000, 400, 20)
    out: dict[str, Any] = {}
    with ctx.bar(len(sets) * len(FAMILIES), "census") as bar:
        for cs in sets:
            out[cs.name] = measure(cs.name, cs.image, per_family, functions, bar=bar)
    rows = []
    for name, r in out.items():
        for family, f in r["families"].items():
            if not f["sites"]:
                continue
            rows.append([name, r["arch"], family, f["sites"], f["examined"], f["spliced_at_site"],
                         f["refused_at_site"], f["moved_without_rules"], f["moved_now"]])
    sites = Table("Sites per family: spliced or refused at the site; moved into a patch (by a "
                  "splice at the site or a neighbouring jmp window) without the hazard rules, "
                  "and now",
                  ["object", "arch", "family", "sites", "examined", "spliced", "refused",
                   "moved before", "moved now"], rows)
    cov_rows = []
    for name, r in out.items():
        c = r["jmp_coverage"]
        cov_rows.append([name, r["functions_sampled"],
                         _pct(c["without_rules"]["entry"]), _pct(c["with_rules"]["entry"]),
                         _pct(c["without_rules"]["block"]), _pct(c["with_rules"]["block"])])
    cov = Table("Entries and block starts a jmp-family tactic splices (%), without and with "
                "the hazard rules", ["object", "functions", "entry before", "entry now",
                                     "block before", "block now"], cov_rows)
    if per_family is not None:
        notes.append(f"{ctx.mode} run: up to {per_family} sites per family and {functions} "
                     "functions per object for coverage, sampled with a fixed seed")
    notes.append("'entry now' is the instruction after the fentry call where a function "
                 "starts with one (an ftrace location is never overwritten); on arm64 after "
                 "the ftrace pair")
    if ARM64_VMLINUX in out:
        notes.append(f"{ARM64_VMLINUX}: {out[ARM64_VMLINUX].get('ftrace_pairs')} ftrace pairs "
                     "(both instructions are ftrace sites); a WARN/BUG BRK #0x800 is refused "
                     "before the rules too (a BRK is a breakpoint to the planner); 'moved "
                     "before' for exclusive is the planner without its exclusive-sequence rule")
    return Section(out, [sites, cov], notes, {"per_family": per_family, "functions": functions})


def _pct(v: float | None) -> float | None:
    return None if v is None else round(100 * v, 1)


def plot(section: dict[str, Any], path: str) -> None:
    plt = pyplot()
    res = section["results"]
    names = [n for n in res if any(f["sites"] for f in res[n]["families"].values())]
    fig, axes = plt.subplots(1, len(names) or 1, figsize=(5 * max(len(names), 1), 4.2),
                             squeeze=False)
    for ax, name in zip(axes[0], names, strict=False):
        fams = [f for f in FAMILIES if res[name]["families"][f]["examined"]]
        ex = [res[name]["families"][f]["examined"] for f in fams]
        before = [100 * res[name]["families"][f]["moved_without_rules"] / e
                  for f, e in zip(fams, ex, strict=True)]
        now = [100 * res[name]["families"][f]["moved_now"] / e
               for f, e in zip(fams, ex, strict=True)]
        ys = range(len(fams))
        ax.barh([y + 0.2 for y in ys], before, height=0.4, color="#d62728", label="without rules")
        ax.barh([y - 0.2 for y in ys], now, height=0.4, color="#2ca02c", label="now")
        ax.set_yticks(list(ys), fams)
        ax.set_xlim(0, 100)
        ax.set_xlabel("% of the family's examined sites")
        ax.set_title(f"{name}: sites moved into a patch (higher is better)")
    if names:
        axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
