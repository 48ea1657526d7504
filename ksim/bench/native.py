"""Native per-hit measurement on real hardware: the toy kernel's C code as a
user process, spliced by ksim's own planner and codegen.

Like User-Mode Linux running a kernel as a process: the toy kernel's C sources
are compiled with the kernel's own flags (images/toy/Makefile) except
``-mcmodel=kernel``, which cannot be used in user space, so they are
position-dependent ``-O2`` code linked ``-no-pie``; their symbols are prefixed
``toy_`` (objcopy) so that the toy's memcpy/strlen/printk cannot clash with libc;
what the assembly files would define is stubbed.  The harness
(benchmarks/native/harness.c) calls ``toy_ksim_bench_target`` in a timed loop.

ksim loads the executable as an Image, and for each variant asks the same
:class:`SiteFacts` and planner tactics the Manager uses for a Patch placed in an
area mmapped at a chosen distance from the text; the harness applies the Patch's
writes to its own text (mprotect) and, for the trap tactic, routes the int3 to
the patch from a SIGTRAP handler — a user-space trap (int3 -> kernel -> signal
-> sigreturn), so two kernel crossings per hit.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import statistics
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ksim.bench.common import Skip
from ksim.bench.kernel import BENCH_CACHE
from ksim.errors import KsimError

REPO = Path(__file__).resolve().parent.parent.parent
HARNESS = REPO / "benchmarks" / "native" / "harness.c"
TOY = REPO / "images" / "toy"
PREFIX = "toy_"
TARGET = PREFIX + "ksim_bench_target"
#: the code-model flag user space cannot use; everything else is the kernel's
DROPPED_FLAGS = ("-mcmodel=kernel",)
PAGE = 0x1000


def toy_cflags() -> list[str]:
    """CFLAGS of images/toy/Makefile (continuation lines joined), minus DROPPED_FLAGS."""
    text = (TOY / "Makefile").read_text().replace("\\\n", " ")
    m = re.search(r"^CFLAGS\s*:?=\s*(.*)$", text, re.M)
    if m is None:
        raise Skip("images/toy/Makefile has no CFLAGS line")
    flags = [f for f in m.group(1).split() if f not in DROPPED_FLAGS]
    return [f"-I{TOY / f[2:]}" if f.startswith("-I") and not f.startswith("-I/") else f for f in flags]


def _sources() -> list[Path]:
    """The toy kernel's x86-64 C files (arch/x86/traps.c too: compiled, never called;
    the other architectures' arch/ and drivers are not part of this build)."""
    return sorted(p for p in TOY.rglob("*.c") if "build" not in p.parts
                  and not (p.relative_to(TOY).parts[0] == "arch" and p.relative_to(TOY).parts[1] != "x86")
                  and p.name != "amba-pl011.c")


def build() -> Path:
    """Build (once per source hash) and return the harness executable."""
    for tool in ("gcc", "objcopy", "nm"):
        if shutil.which(tool) is None:
            raise Skip(f"{tool} is not installed")
    flags = toy_cflags()
    h = hashlib.sha256(" ".join(flags).encode())
    for path in [HARNESS, *_sources(), *sorted((TOY / "include").glob("*.h"))]:
        h.update(path.read_bytes())
    out = BENCH_CACHE / "native" / h.hexdigest()[:16]
    exe = out / "harness"
    if exe.exists():
        return exe
    out.mkdir(parents=True, exist_ok=True)
    objs = []
    for src in _sources():
        obj = out / (str(src.relative_to(TOY)).replace("/", "_")[:-2] + ".o")
        _sh(["gcc", *flags, "-c", "-o", str(obj), str(src)])
        _sh(["objcopy", f"--prefix-symbols={PREFIX}", str(obj)])
        objs.append(obj)
    stubs = out / "stubs.c"
    stubs.write_text(_stubs(objs))
    _sh(["gcc", "-O2", "-fno-pie", "-c", "-o", str(out / "stubs.o"), str(stubs)])
    _sh(["gcc", "-O2", "-fno-pie", "-Wall", "-c", "-o", str(out / "harness.o"), str(HARNESS)])
    tmp = out / "harness.tmp"
    _sh(["gcc", "-no-pie", "-o", str(tmp), str(out / "harness.o"), str(out / "stubs.o"),
         *map(str, objs)])
    tmp.replace(exe)
    return exe


def _stubs(objs: list[Path]) -> str:
    """A trapping function for every toy symbol no C file defines (the assembly's)."""
    defined: set[str] = set()
    undefined: set[str] = set()
    for obj in objs:
        for line in _sh(["nm", str(obj)]).splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0] == "U":
                undefined.add(parts[1])
            elif len(parts) == 3:
                defined.add(parts[2])
    missing = sorted(s for s in undefined - defined if s.startswith(PREFIX))
    lines = ["/* generated: what the toy kernel's assembly files define (never reached) */"]
    lines += [f"void {s}(void) {{ __builtin_trap(); }}" for s in missing]
    return "\n".join(lines) + "\n"


def _sh(cmd: list[str]) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise Skip(f"native build failed: {' '.join(cmd[:3])} ...: {proc.stderr.strip()[-600:]}")
    return proc.stdout


# --- planning with ksim's planner ------------------------------------------------
@dataclass
class Variant:
    name: str
    tactic: str | None          # None: uninstrumented
    distance: int = 16 * PAGE   # bytes from the point to the patch area
    calls: int = 1_000_000
    repeats: int = 21
    #: "count": the entry counter (lock add 1); "empty": no snippet, the splice alone
    snippet: str = "count"


class NativePlanner:
    """SiteFacts + planner tactics over the harness executable's own text."""

    def __init__(self, exe: Path) -> None:
        from ksim.arch import get_arch
        from ksim.image import load_image
        from ksim.splice.sites import SiteFacts

        self.exe = exe
        self.image = load_image(exe)
        self.arch = get_arch("x86_64")
        self.facts = SiteFacts(self.image, self.arch)
        self.func = self.image.function(TARGET)
        # the patch area goes past everything the executable maps (text, data, bss)
        image_end = max(sec.end for sec in self.image.sections if sec.address)
        self.image_end = (image_end + PAGE - 1) & ~(PAGE - 1)

    def script(self, v: Variant) -> tuple[str, dict[str, Any]]:
        """The harness commands for one variant, and what was planned."""
        if not v.name or any(c.isspace() for c in v.name):
            raise ValueError(f"a variant name is one word: {v.name!r}")
        from ksim.core import KernelABI, MemRef
        from ksim.snippets import ast
        from ksim.splice import planner

        lines = [f"variant {v.name} {v.calls} {v.repeats}"]
        info: dict[str, Any] = {"variant": v.name, "tactic": v.tactic}
        if v.tactic is None:
            return "\n".join(lines + ["run", ""]), info
        point = self.facts.entry(self.func)
        area = (point.address + v.distance) & ~(PAGE - 1)
        area = max(area, self.image_end + 16 * PAGE)
        if v.tactic == "far":  # the counter stays near (the codegen's absolute addressing)
            area = max((point.address + 16 * PAGE) & ~(PAGE - 1), self.image_end + 16 * PAGE)
        data = area + PAGE  # the counter: a page of its own after the code page
        counter = ast.Var(data, 8)
        snippet = counter.atomic_assign(counter + 1) if v.snippet == "count" else ast.Seq(())
        live = self.facts.live_at(point)
        abi = KernelABI(current_task=MemRef(data + 8, None, 8), task_pid_offset=0,
                        cpu_number=MemRef(data + 16, None, 4))

        def compile_at(address: int) -> bytes:
            return self.arch.compile_snippets([snippet], address, live=live, abi=abi,
                                              point_kind=point.kind.value)

        if v.tactic == "far":
            return self._far(v, point.address, compile_at, lines, info)
        req = self.facts.request(point.address, self.facts.function_code(self.func),
                                 compile_at, area)
        try:
            result = planner.TACTICS[v.tactic](self.arch, req)
        except KsimError as exc:  # e.g. the jump back from a far patch is out of range
            result = f"{type(exc).__name__}: {exc}"
        info.update(distance=area - point.address, area=area, point=point.address)
        if isinstance(result, str):
            info["refused"] = result
            return "", info
        info.update(patch_bytes=len(result.code), writes=[(w.address, w.new.hex()) for w in result.writes])
        lines.append(f"area {area:x} {2 * PAGE:x}")
        lines.append(f"code {area:x} {result.code.hex()}")
        for w in result.writes:
            lines.append(f"write {w.address:x} {w.new.hex()}")
        if result.trap_site is not None:
            lines.append(f"trap {result.trap_site:x} {result.code_address:x}")
        lines.append(f"counter {data:x}")
        lines.append("run")
        return "\n".join(lines) + "\n", info


    def _far(self, v: Variant, point: int, compile_at: Any, lines: list[str],
             info: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """A far jump, which no ksim tactic emits (measured to show what going past
        +-2 GB would cost): jmp rel32 to a stub in the near area, ``jmp [rip]`` to the
        patch far away, and ``jmp [rip]`` back.  The snippet and the relocated
        instruction are ksim's own codegen and relocator; the counter stays near."""
        fc = self.facts.function_code(self.func)
        insn = fc.insns[fc.index_of(point)]
        if insn.size < self.arch.jmp_size:
            info["refused"] = "the hand-built far jump needs a first instruction of >= 5 bytes"
            return "", info
        near = max((point + 16 * PAGE) & ~(PAGE - 1), self.image_end + 16 * PAGE)
        far = (point + v.distance) & ~(PAGE - 1)
        jmp_abs = bytes.fromhex("ff2500000000")  # jmp qword [rip+0]; the address follows
        body = compile_at(far)
        code = (body + self.arch.relocate([insn], far + len(body))
                + jmp_abs + insn.end.to_bytes(8, "little"))
        stub = jmp_abs + far.to_bytes(8, "little")
        head = self.arch.jmp(point, near)
        head += bytes([self.arch.pad_byte]) * (insn.size - len(head))
        info.update(distance=far - point, area=far, point=point, patch_bytes=len(code),
                    writes=[(point, head.hex())])
        lines += [f"area {near:x} {2 * PAGE:x}", f"code {near:x} {stub.hex()}",
                  f"area {far:x} {PAGE:x}", f"code {far:x} {code.hex()}",
                  f"write {point:x} {head.hex()}", f"counter {near + PAGE:x}", "run"]
        return "\n".join(lines) + "\n", info


def measure(variants: list[Variant], *, rounds: int = 3, timeout: float = 600) -> list[dict[str, Any]]:
    """Plan every variant, run them all in one harness process (one after the other,
    each undone before the next; the whole list ``rounds`` times, interleaved, so that
    a noisy moment of a shared machine hits every variant alike), and return one record
    per variant: the minimum over rounds of the per-round minimum, and the median of
    the per-round medians."""
    exe = build()
    np_ = NativePlanner(exe)
    scripts, infos = [], []
    for v in variants:
        text, info = np_.script(v)
        scripts.append(text)
        infos.append(info)
    proc = subprocess.run([str(exe)], input="".join(scripts) * rounds, capture_output=True,
                          text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"native harness exited {proc.returncode}: {proc.stderr.strip()[-400:]}")
    per: dict[str, list[dict[str, Any]]] = {}
    for rec in map(json.loads, proc.stdout.splitlines()):
        per.setdefault(rec["variant"], []).append(rec)
    measured = {}
    for name, recs in per.items():
        best = dict(recs[-1])
        if "min_cycles_per_call" in best:
            best["min_cycles_per_call"] = min(r["min_cycles_per_call"] for r in recs)
            best["median_cycles_per_call"] = statistics.median(r["median_cycles_per_call"] for r in recs)
            best["max_cycles_per_call"] = max(r["max_cycles_per_call"] for r in recs)
            best["rounds"] = len(recs)
            best["counters"] = [r.get("counter") for r in recs]
        measured[name] = best
    out = []
    for v, info in zip(variants, infos, strict=False):
        rec = dict(info)
        rec.update(measured.get(v.name, {}))
        rec["snippet"] = v.snippet if v.tactic else None
        if v.tactic is not None and v.snippet == "count" and "counters" in rec:
            # each round maps a fresh patch area: its counter starts at zero
            expected = v.calls * v.repeats + v.calls // 10 + 1
            rec["counter_expected"] = expected
            rec["counter_ok"] = all(c == expected for c in rec["counters"])
        out.append(rec)
    return out


def harness_target_size() -> int:
    exe = build()
    return NativePlanner(exe).func.size


def cpu_has_rdtscp() -> bool:
    try:
        return " rdtscp" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def available() -> str | None:
    """None when native measurement can run here, else why not."""
    if os.uname().machine != "x86_64":
        return f"not an x86-64 host ({os.uname().machine})"
    if not cpu_has_rdtscp():
        return "the CPU has no rdtscp"
    return None
