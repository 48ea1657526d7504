"""per-hit: what one hit of an instrumented function costs, jmp versus trap (the
paper's Table 1, re-measured).

The snippet is an entry counter (``v.atomic_assign(v + 1)``), spliced by ksim's
Manager (unicorn, QEMU) or by the same planner and codegen in a user-mode build
(native), next to the uninstrumented function in the same run:

* **native** — real hardware: the toy kernel's C code as a process
  (:mod:`ksim.bench.native`), ``ksim_bench_target`` called in a timed loop; TSC
  cycles per call for uninstrumented, jmp, springboard and trap (a user-space
  trap: int3 -> SIGTRAP handler -> sigreturn).
* **unicorn** — the toy kernel emulated: emulated instructions per hit (exact, the
  runs are deterministic) and wall time per hit; beside them the wall time per hit
  of a Python exact-address hook (unicorn's own instrumentation), for contrast.
* **qemu** — the toy kernel under qemu-system-x86_64 (TCG here): emulated time per
  hit.  Never hardware figures.
* **live** — the Debian kernel of the testbed, when it is up: a guest program times
  getpid while ``__task_pid_nr_ns`` (which getpid calls) carries, in turn, nothing, ksim's jmp and trap
  counters, the kernel's own kprobes (int3, jump-optimized, ftrace-based at +0), and
  Debian's bpftrace counting it with ``kprobe:`` and with ``kfunc:`` (``@ =
  count()``, :mod:`ksim.bench.bpftrace`) -- one guest, one run.  Emulated cycles
  under TCG, never hardware figures.  A variant that cannot run here (no bpftrace,
  or ``KSIM_BPFTRACE`` names none) is a row ``{"variant": ..., "skipped": reason}``
  and one that fails a row with ``"error"``; the other rows stay.

Emulated targets measure the seeded workload with the probe on its hottest
function that the given tactic can splice (hits counted by the snippet itself),
and the image's bench mode (rdtsc around N calls of ``ksim_bench_target``) when
that mode really calls the function.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from ksim.bench import native
from ksim.bench.common import Context, Section, Skip, Table, attempt, pyplot, save
from ksim.bench.sizes import _fentry_site
from ksim.errors import KsimError
from ksim.splice.patch import Change

NAME = "per-hit"
TITLE = "Cost per hit: uninstrumented, jmp, springboard, trap (paper Table 1)"
#: below this many hits in a run, a per-hit wall time is lost in run-to-run noise
MIN_HITS_FOR_TIME = 5_000
PAPER: dict[str, float] = {"jmp": 84.0012, "trap": 1613.5124}  # Pentium 4 1.4 GHz, Linux 2.4.20


def run(ctx: Context) -> Section:
    results: dict[str, Any] = {}
    notes: list[str] = []
    tables: list[Table] = []
    steps: list[tuple[str, Any]] = [("native", _native), ("unicorn", _unicorn), ("qemu", _qemu),
                                    ("live", _live)]
    if ctx.arch == "arm64":  # the arm64 testbed's live rows (the rest is x86-64's toy)
        steps = [("live_arm64", lambda c: _live(c, "arm64"))]
    with ctx.bar(len(steps), "per-hit") as bar:
        for name, fn in steps:
            bar.advance(0, note=name)
            part = attempt(name, results, notes, fn, ctx)
            if part is not None:
                results[name] = part[0]
                tables += part[1]
                notes += part[2]
            bar.advance(note=name)
    return Section(results, tables, notes, {"mode": ctx.mode})


# --- native ------------------------------------------------------------------------------
def _native(ctx: Context) -> tuple[dict[str, Any], list[Table], list[str]]:
    why = native.available()
    if why:
        raise Skip(why)
    calls, repeats = ctx.pick((1_000_000, 31), (300_000, 11), (2_000, 3))
    tcalls, trepeats = ctx.pick((30_000, 11), (5_000, 5), (100, 2))
    V = native.Variant
    variants = [
        V("uninstrumented", None, calls=calls, repeats=repeats),
        V("jmp", "jmp", calls=calls, repeats=repeats),
        V("springboard", "springboard", calls=calls, repeats=repeats),
        V("trap", "trap", calls=tcalls, repeats=trepeats),
        V("jmp-empty-snippet", "jmp", calls=calls, repeats=repeats, snippet="empty"),
        V("trap-empty-snippet", "trap", calls=tcalls, repeats=trepeats, snippet="empty"),
    ]
    rows = native.measure(variants, rounds=ctx.pick(5, 3, 1))
    base = rows[0].get("min_cycles_per_call", 0.0)
    for r in rows:
        if "min_cycles_per_call" in r:
            r["overhead_cycles"] = r["min_cycles_per_call"] - base
    by = {r["variant"]: r for r in rows}
    jmp_o = by["jmp"].get("overhead_cycles")
    trap_o = by["trap"].get("overhead_cycles")
    ratio = trap_o / jmp_o if jmp_o and trap_o and jmp_o > 0 else None
    table = Table(
        "Native, real hardware: TSC cycles per call of ksim_bench_target (user-mode toy kernel)",
        ["variant", "patch B", "cycles/call (min)", "median", "overhead/hit", "counter ok"],
        [[r["variant"], r.get("patch_bytes"), r.get("min_cycles_per_call"),
          r.get("median_cycles_per_call"), _round(r.get("overhead_cycles")), r.get("counter_ok")]
         for r in rows])
    t1 = Table("Table 1 re-measured (cycles per hit)", ["", "paper (P4, kernel)", "ksim native (user space)"],
               [["jmp", PAPER["jmp"], _round(jmp_o)],
                ["trap", PAPER["trap"], _round(trap_o)],
                ["trap / jmp", round(PAPER["trap"] / PAPER["jmp"], 1), _round(ratio)]])
    notes = ["native: TSC ticks (constant reference rate) on the host CPU; the trap is a "
             "user-space trap (int3 -> SIGTRAP handler -> sigreturn), two kernel crossings per "
             "hit, heavier than an in-kernel int3 handler; overhead = variant - uninstrumented "
             "(minimum over repeats and rounds)"]
    return {"rows": rows, "trap_over_jmp": ratio, "unit": "TSC cycles"}, [table, t1], notes


# --- emulated targets ----------------------------------------------------------------
def _hot_functions(spec: str) -> list[tuple[int, str]]:
    """Function entry hit counts of the seeded workload (unicorn's exact-address hooks)."""
    import contextlib

    from ksim.kapi import Manager

    with Manager.attach(spec) as m, contextlib.ExitStack() as stack:
        counters = {f.name: stack.enter_context(m.oracle(f.address))
                    for f in m.target.image.functions}
        m.run(seed=1)
        return sorted(((c.count, n) for n, c in counters.items() if c.count), reverse=True)


def _pick_sites(hot: list[tuple[int, str]]) -> dict[str, tuple[str, int]]:
    """The hottest function whose entry the jmp policy splices by a plain jmp, and the
    hottest one it can only splice by a springboard."""
    from ksim.kapi import Manager

    out: dict[str, tuple[str, int]] = {}
    with Manager.attach("unicorn:toy") as m:
        for hits, name in hot:
            try:
                tactic = m._plan(m.entry_point(name), [], "jmp", dry_run=True).tactic
            except Exception:  # noqa: BLE001 - not spliceable by jmp: look further
                continue
            if m.can_insert(m.entry_point(name), "trap") is not None:
                continue
            key = "jmp" if tactic == "jmp" else "springboard" if tactic == "springboard" else None
            if key and key not in out:
                out[key] = (name, hits)
            if len(out) == 2:
                break
    return out


def _measure_site(spec: str, func: str, variants: list[str], iterations: int, repeats: int,
                  *, instructions: bool, hook: bool) -> list[dict[str, Any]]:
    """Per variant: hits, emulated instructions (unicorn), best wall time over ``repeats``
    rounds; each round runs every variant once, interleaved, so that the load of a shared
    machine falls on all of them alike (and translation caches are warm for all)."""
    from ksim.kapi import Manager

    names = list(variants) + (["python address hook"] if hook else [])
    recs: dict[str, dict[str, Any]] = {n: {"function": func, "variant": n, "times": []} for n in names}
    with Manager.attach(spec) as m:
        point = m.entry_point(func)
        counter = m.malloc(8)

        def once(name: str, count: bool) -> None:
            rec = recs[name]
            handle = None
            if name not in ("uninstrumented", "python address hook"):
                policy = "trap" if name == "trap" else "jmp"
                handle = m.insert_snippet(point, counter.atomic_assign(counter + 1), splice=policy)
                rec["tactic"] = m.splices()[point.address][0]
            try:
                m.write(counter, 0)
                if name == "python address hook":
                    with m.oracle(point.address) as oc:
                        r = m.run(seed=1, iterations=iterations, count_instructions=count)
                    rec["hits"] = oc.count
                else:
                    r = m.run(seed=1, iterations=iterations, count_instructions=count)
                    if handle is not None:
                        rec["hits"] = m.read(counter)
                rec["checksum"] = r.checksum
                if count:
                    rec["instructions"] = r.instructions
                else:
                    rec["times"].append(r.seconds)
            finally:
                if handle is not None:
                    m.remove_snippet(handle)

        if instructions:
            for name in names:
                once(name, True)
        for name in names:  # warm-up: every variant translated once
            once(name, False)
        for rec in recs.values():
            rec["times"].clear()
        for _ in range(repeats):
            for name in names:
                once(name, False)
    rows = [recs[n] for n in names]
    for rec in rows:
        rec["seconds"] = min(rec["times"])
    base = rows[0]
    for rec in rows[1:]:
        hits = rec.get("hits") or 0
        if hits >= MIN_HITS_FOR_TIME:  # fewer hits: run-to-run noise exceeds the difference
            rec["wall_ns_per_hit"] = 1e9 * (rec["seconds"] - base["seconds"]) / hits
        if hits:
            if rec.get("instructions") is not None and base.get("instructions") is not None:
                rec["insns_per_hit"] = (rec["instructions"] - base["instructions"]) / hits
        rec["same_checksum"] = rec.get("checksum") == base.get("checksum")
    return rows


def _emulated(ctx: Context, spec: str, label: str, *, instructions: bool) -> tuple[dict[str, Any], list[Table], list[str]]:
    hot = _hot_functions("unicorn:toy")
    sites = _pick_sites(hot)
    if not sites:
        raise Skip("no hot toy function can be spliced by jmp and by trap")
    iterations, repeats = ctx.pick((60_000, 5), (6_000, 4), (50, 1))
    rows: list[dict[str, Any]] = []
    for key, (func, _hits) in sites.items():
        variants = ["uninstrumented", key, "trap"]
        rows += _measure_site(spec, func, variants, iterations, repeats,
                              instructions=instructions, hook=instructions and key == "jmp")
    bench = _bench_mode(ctx, spec)
    cols = ["function", "variant", "tactic", "hits", "insns/hit", "wall ns/hit", "same checksum"]
    table = Table(f"{label}: seeded workload, {iterations} iterations, entry counter on hot functions",
                  cols, [[r["function"], r["variant"], r.get("tactic", "-"), r.get("hits"),
                          _round(r.get("insns_per_hit")), _round(r.get("wall_ns_per_hit")),
                          r.get("same_checksum")] for r in rows])
    tables = [table]
    if bench.get("rows"):
        tables.append(Table(f"{label}: bench mode, {bench['calls']} calls of ksim_bench_target",
                            ["variant", "emulated cycles/call", "+cycles/hit", "insns/call",
                             "+insns/hit", "wall ns/call", "+wall ns/hit"],
                            [[r["variant"], _round(r.get("cycles_per_call")),
                              _round(r.get("cycles_per_hit")), _round(r.get("insns_per_call")),
                              _round(r.get("insns_per_hit")), _round(r.get("wall_ns_per_call")),
                              _round(r.get("wall_ns_per_hit"))] for r in bench["rows"]]))
    notes = [f"{label}: bench mode: {bench.get('skipped') or bench.get('unit')}"]
    return {"workload": rows, "sites": sites, "bench_mode": bench, "iterations": iterations}, tables, notes


def _bench_mode(ctx: Context, spec: str) -> dict[str, Any]:
    """The image's own loop around N calls of ksim_bench_target, if it really calls it:
    its rdtsc delta (QEMU), the emulated instructions (unicorn), the wall time (both)."""
    from ksim.kapi import Manager

    calls = ctx.pick(1_000_000, 200_000, 1_000)
    count = spec.startswith("unicorn")
    out: list[dict[str, Any]] = []
    with Manager.attach(spec) as m:
        point = m.entry_point("ksim_bench_target")
        counter = m.malloc(8)
        variants = ["uninstrumented", "jmp", "trap"] + (["python address hook"] if count else [])
        for variant in variants:
            handle = None
            if variant in ("jmp", "trap"):
                handle = m.insert_snippet(point, counter.atomic_assign(counter + 1), splice=variant)
            try:
                m.write(counter, 0)
                if variant == "python address hook":  # unicorn's own instrumentation
                    with m.oracle(point.address) as oc:
                        r = m.run(bench_calls=calls, count_instructions=count)
                        seconds = min([r.seconds] + [m.run(bench_calls=calls).seconds
                                                     for _ in range(2)])
                    if oc.count != 3 * calls:
                        return {"skipped": f"the address hook counted {oc.count} calls, "
                                           f"not {3 * calls}"}
                    out.append({"variant": variant, "cycles_per_call": None,
                                "insns_per_call": r.instructions / calls if r.instructions else None,
                                "wall_ns_per_call": 1e9 * seconds / calls})
                    continue
                r = m.run(bench_calls=calls, count_instructions=count)
                if handle is not None and m.read(counter) != calls:
                    return {"skipped": f"the image's bench loop did not call ksim_bench_target "
                                       f"{calls} times (the snippet counted {m.read(counter)}); "
                                       "no bench-mode figures"}
                seconds = min([r.seconds] + [m.run(bench_calls=calls).seconds for _ in range(2)])
                cycles = getattr(r, "bench_cycles", None)
                out.append({"variant": variant,
                            "cycles_per_call": cycles / calls if cycles else None,
                            "insns_per_call": r.instructions / calls if r.instructions else None,
                            "wall_ns_per_call": 1e9 * seconds / calls})
            finally:
                if handle is not None:
                    m.remove_snippet(handle)
    base = out[0]
    for row in out[1:]:
        for key in ("cycles_per_call", "insns_per_call", "wall_ns_per_call"):
            if base.get(key) is not None and row.get(key) is not None:
                row[key.replace("_per_call", "_per_hit")] = row[key] - base[key]
    unit = ("emulated instructions (exact) and host wall time" if count
            else "emulated rdtsc cycles (never hardware figures) and host wall time")
    return {"rows": out, "calls": calls, "unit": unit}


def _unicorn(ctx: Context) -> tuple[dict[str, Any], list[Table], list[str]]:
    res, tables, notes = _emulated(ctx, "unicorn:toy", "unicorn", instructions=True)
    notes.append("unicorn: insns/hit = extra emulated instructions per hit (exact); wall ns/hit = "
                 "extra host time per hit, best of the repeats; the Python address hook is "
                 "unicorn's own exact-address instrumentation, for contrast")
    return res, tables, notes


def _qemu(ctx: Context) -> tuple[dict[str, Any], list[Table], list[str]]:
    import shutil

    if shutil.which("qemu-system-x86_64") is None:
        raise Skip("qemu-system-x86_64 is not installed")
    res, tables, notes = _emulated(ctx, "qemu:toy", "qemu", instructions=False)
    notes.append("qemu: TCG (no working KVM here): wall ns/hit is emulated time, not hardware")
    return res, tables, notes


#: the probed function: getpid's body (task_tgid_vnr, an inline) calls it once per call,
#: and unlike the syscall wrapper __x64_sys_getpid it has BTF, so bpftrace's kfunc
#: probe attaches to it like every other tool
LIVE_FUNCTION = "__task_pid_nr_ns"
#: the trap-dispatch figure's function (the batch benchmark)
DISPATCH_FUNCTION = "__x64_sys_getpid"
DISPATCH_FUNCTION_ARM64 = "__arm64_sys_getpid"
GUEST_PROGRAM = native.REPO / "benchmarks" / "native" / "guest_getpid.c"
#: the arm64 testbed's: the virtual counter (CNTVCT_EL0) instead of rdtsc
GUEST_PROGRAM_ARM64 = native.REPO / "benchmarks" / "native" / "guest_getpid_arm64.c"


#: the static C library the guest program is linked with (libc6-dev)
STATIC_LIBC = Path("/usr/lib/x86_64-linux-gnu/libc.a")


def _guest_program(arch: str = "x86_64") -> str:
    """The guest's rdtsc getpid loop, built statically on the host (the guest runs the
    host's root filesystem, so the host path works inside it); for the arm64 testbed
    its CNTVCT_EL0 loop, cross-built into the cache the guest mounts at the same path."""
    import hashlib
    import subprocess

    if arch == "arm64":
        from ksim.live import arm64bed

        src = GUEST_PROGRAM_ARM64.read_bytes()
        out = arm64bed.arm64_dir() / "bin" / f"guest_getpid-{hashlib.sha256(src).hexdigest()[:12]}"
        if not out.exists():
            try:
                cc = arm64bed.cross_cc()
            except KsimError as exc:
                raise Skip(f"cannot build the arm64 guest program: {exc}") from None
            out.parent.mkdir(parents=True, exist_ok=True)
            proc = subprocess.run([cc, "-O2", "-static", "-o", str(out), str(GUEST_PROGRAM_ARM64)],
                                  capture_output=True, text=True, timeout=120)
            if proc.returncode != 0:
                raise Skip(f"cannot build the arm64 guest program: {proc.stderr.strip()[-300:]}")
        return str(out)
    src = GUEST_PROGRAM.read_bytes()
    out = native.BENCH_CACHE / "live" / hashlib.sha256(src).hexdigest()[:12] / "guest_getpid"
    if not out.exists():
        lacking = [pkg for pkg, present in (("gcc", shutil.which("gcc")),
                                            ("libc6-dev", STATIC_LIBC.exists())) if not present]
        if lacking:
            from ksim.live import testbed

            try:
                testbed.ensure_tools(tuple(lacking))
            except KsimError as exc:
                raise Skip(f"cannot build the guest program: {exc}") from None
        out.parent.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(["gcc", "-O2", "-static", "-o", str(out), str(GUEST_PROGRAM)],
                              capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise Skip(f"cannot build the guest program: {proc.stderr.strip()[-300:]}")
    return str(out)


def _row(rows: list[dict[str, Any]], variant: str, measure: Any) -> None:
    """One row of the live table: what ``measure`` returns, or -- when it cannot run
    here (Skip) or fails (the kernel refused a probe, the testbed hung up) -- the
    variant with the reason, so that the rows before and after it stay."""
    try:
        rows.append(measure())
    except Skip as exc:
        rows.append({"variant": variant, "skipped": str(exc)})
    except (OSError, KsimError) as exc:
        rows.append({"variant": variant, "error": f"{type(exc).__name__}: {exc}"})


def _live(ctx: Context, instance: str | None = None, sizes: tuple[int, int] | None = None
          ) -> tuple[dict[str, Any], list[Table], list[str]]:
    """The live rows on the testbed ``instance`` (None: the x86-64 one; "arm64": the
    arm64 one, where the kernel's kprobe is a BRK, there are no optprobes, and the
    guest's counter is CNTVCT_EL0)."""
    import json
    import time

    try:
        from ksim.live import testbed
    except ImportError as exc:
        raise Skip(f"the live testbed is not part of this installation ({exc})") from exc
    if ctx.smoke:
        raise Skip("smoke run: the live testbed is left alone")
    state = testbed.status(instance)
    if not state.get("up"):
        flag = " --arch arm64" if instance == "arm64" else ""
        raise Skip(f"the Linux testbed is not up (start it with `ksim testbed up{flag}`); live "
                   "per-hit figures next to the kernel's kprobes need it")
    from ksim.kapi import Manager

    arm64 = state.get("arch") == "arm64"
    prog = _guest_program("arm64" if arm64 else "x86_64")
    calls, repeats = ctx.pick((100_000, 7), (20_000, 5), (500, 1))
    if arm64:  # TCG emulating AArch64 on this host is several times slower
        calls, repeats = ctx.pick((30_000, 5), (10_000, 3), (300, 1))
    if sizes is not None:  # the tests' sizes: getpids per repeat, repeats
        calls, repeats = sizes
    cmd = f"{prog} {calls} {repeats}"
    tracefs = "/sys/kernel/tracing"
    rows: list[dict[str, Any]] = []
    with Manager.attach(state["address"]) as m:
        t: Any = m.target  # the live target: exec() runs commands in the guest
        point = m.entry_point(LIVE_FUNCTION)
        fn = m.find_function(LIVE_FUNCTION)
        head = t.read(fn.address, 16)  # the function's first instruction: ftrace's site or not

        def measure(variant: str, **extra: Any) -> dict[str, Any]:
            r = t.run(while_cmd=cmd, timeout=1800)
            return {"variant": variant, **json.loads(r.output.strip().splitlines()[-1]), **extra}

        def kprobe(offset: int, optimize: bool) -> tuple[str, str]:
            event = f"ksim_bench_{offset}_{int(optimize)}"
            if arm64:  # no optprobes: no such sysctl
                t.exec_checked(f"echo 'p:{event} {LIVE_FUNCTION}+{offset}' >> "
                               f"{tracefs}/kprobe_events && "
                               f"echo 1 > {tracefs}/events/kprobes/{event}/enable")
                return event, ""
            saved = t.exec("cat /proc/sys/debug/kprobes-optimization").strip() or "1"
            t.exec_checked(f"echo {int(optimize)} > /proc/sys/debug/kprobes-optimization && "
                           f"echo 'p:{event} {LIVE_FUNCTION}+{offset}' >> {tracefs}/kprobe_events && "
                           f"echo 1 > {tracefs}/events/kprobes/{event}/enable")
            if optimize:
                time.sleep(2.0)  # kprobes optimizes after a delay (kernel/kprobes.c)
            return event, saved

        def unkprobe(event: str, saved: str) -> int:
            prof = t.exec(f"cat {tracefs}/kprobe_profile")
            hits = next((int(ln.split()[1]) for ln in prof.splitlines()
                         if ln.split() and ln.split()[0] == event), -1)
            t.exec_checked(f"echo 0 > {tracefs}/events/kprobes/{event}/enable; "
                           f"echo '-:{event}' >> {tracefs}/kprobe_events" + (
                               "" if arm64 else
                               f"; echo {saved} > /proc/sys/debug/kprobes-optimization"))
            time.sleep(1.0)  # un-optimizing is asynchronous
            return hits

        # the baseline every overhead is taken from: without it no row means anything
        rows.append(measure("uninstrumented"))
        counter = m.malloc(8)

        def ksim_counter(policy: str) -> dict[str, Any]:
            m.write(counter, 0)
            h = m.insert_snippet(point, counter.atomic_assign(counter + 1), splice=policy)
            try:
                rec = measure(f"ksim {policy}", tactic=m.splices()[point.address][0])
                rec["hits"] = m.read(counter)
                return rec
            finally:
                m.remove_snippet(h)

        def kernel_kprobe(label: str, offset: int, opt: bool) -> dict[str, Any]:
            event, saved = kprobe(offset, opt)
            try:
                listing = t.exec("mountpoint -q /sys/kernel/debug || mount -t debugfs none "
                                 "/sys/kernel/debug 2>/dev/null; grep " + LIVE_FUNCTION +
                                 " /sys/kernel/debug/kprobes/list 2>/dev/null").strip()
                rec = measure(label, probe=f"{LIVE_FUNCTION}+{offset}", kprobe_state=listing)
            finally:
                hits = unkprobe(event, saved)
            rec["hits"] = hits
            return rec

        for policy in ("jmp", "trap"):
            _row(rows, f"ksim {policy}", lambda policy=policy: ksim_counter(policy))
        # past the function's ftrace site (the kernel's jump-sized nop, or its call
        # while a tracer is on: ksim.bench.sizes._fentry_site's answer)
        first = next(iter(t.arch.decode(head, fn.address)), None)
        past_nop = first.size if first is not None and _fentry_site(t.arch, first) else 0
        kprobes: tuple[tuple[str, int, bool], ...] = (
            ("kprobe int3", past_nop, False), ("kprobe optimized (jump)", past_nop, True),
            ("kprobe at +0 (ftrace)", 0, False))
        if arm64:  # a BRK past the ftrace pair, where ksim's entry point is too
            kprobes = (("kprobe BRK", point.address - fn.address, False),)
        for label, offset, opt in kprobes:
            _row(rows, label, lambda label=label, offset=offset, opt=opt:
                 kernel_kprobe(label, offset, opt))
        for kind in ("kprobe", "kfunc"):
            _row(rows, f"bpftrace {kind} count()",
                 lambda kind=kind: _bpftrace_count(t, kind, cmd, arm64=arm64))
    base = rows[0]["min_cycles_per_call"]
    for r in rows[1:]:
        if r.get("min_cycles_per_call") is not None:
            r["overhead"] = r["min_cycles_per_call"] - base
    unit = "CNTVCT_EL0 ticks" if arm64 else "emulated cycles"
    table = Table(f"live ({state.get('kernel')}, {state.get('accel')}): {unit} per "
                  f"getpid ({LIVE_FUNCTION}, which getpid calls, probed), {calls} calls",
                  ["variant", "tactic/probe", f"{'ticks' if arm64 else 'cycles'}/call (min)",
                   "median", "overhead/hit", "hits"],
                  [[r["variant"], r.get("tactic") or r.get("probe", "-"),
                    r.get("min_cycles_per_call", "skipped" if "skipped" in r else "error"),
                    r.get("median_cycles_per_call"), _round(r.get("overhead")), r.get("hits")]
                   for r in rows])
    label = "live_arm64" if arm64 else "live"
    notes = [f"live: the testbed kernel runs under {state.get('accel')}: cycles are the guest's "
             "rdtsc (emulated under TCG), never hardware figures; hits = the snippet's counter or "
             "kprobe_profile (>= calls x repeats: other processes call getpid too)"]
    if arm64:
        hz = next((r.get("counter_hz") for r in rows if r.get("counter_hz")), None)
        notes = [f"live_arm64: Debian's arm64 kernel in qemu-system-aarch64 under "
                 f"{state.get('accel')} (emulated, never hardware figures): ticks of the guest's "
                 f"virtual counter CNTVCT_EL0 ({hz} Hz) per getpid; the kernel's kprobe is a BRK "
                 "(arm64 has no optprobes; its config has no KPROBES_ON_FTRACE, so bpftrace's "
                 "kprobe at +0 is a BRK kprobe too, and no DYNAMIC_FTRACE_WITH_DIRECT_CALLS, "
                 "which bpftrace's kfunc probes fail to attach without); hits = the snippet's "
                 "counter, kprobe_profile or bpftrace's @"]
    notes += [f"{label}: {r['variant']}: " + (f"skipped: {r['skipped']}" if "skipped" in r
                                           else f"failed: {str(r['error'])[-300:]}")
              for r in rows if "skipped" in r or "error" in r]
    return {"rows": rows, "function": LIVE_FUNCTION, "entry_bytes": head.hex(),
            "accel": state.get("accel"), "kernel": state.get("kernel"),
            "entry_size": fn.size}, [table], notes


def _bpftrace_count(t: Any, kind: str, cmd: str, *, arm64: bool = False) -> dict[str, Any]:
    """bpftrace's ``count()`` on LIVE_FUNCTION (a ``kprobe:`` -- ftrace-based at +0 --
    or a ``kfunc:``, a BPF trampoline), timed by the same guest program while it runs.
    Skip when there is no bpftrace to run (:func:`ksim.bench.bpftrace.binary`)."""
    import json

    from ksim.bench import bpftrace
    from ksim.live import testbed

    exe, python = bpftrace.guest_tools(t) if arm64 else (bpftrace.binary(), None)
    program = f"{kind}:{LIVE_FUNCTION} {{ @ = count(); }}\n" + bpftrace.READY_PROBE
    work = testbed.cache_dir() / "bench-per-hit"
    out = bpftrace.run(t, program, cmd, 1800.0, work, f"count-{kind}.bt", exe, python=python)
    rec: dict[str, Any] = {"variant": f"bpftrace {kind} count()", "probe": f"{kind}:{LIVE_FUNCTION}",
                           "bpftrace": exe, "min_cycles_per_call": None,
                           "median_cycles_per_call": None}
    if out.get("status") != "ok":
        rec["error"] = out.get("output", out.get("status"))
        return rec
    try:
        rec.update(json.loads(out["workload_output"].strip().splitlines()[-1]))
    except (ValueError, IndexError):
        rec["error"] = f"no figures from the guest program: {out['workload_output'][-300:]!r}"
    rec["hits"] = out.get("hits")
    return rec


def _round(v: Any) -> Any:
    return round(v, 2) if isinstance(v, float) else v


def plot(section: dict[str, Any], path: str) -> None:
    plt = pyplot()
    res = section["results"]
    live_rows = res.get("live", {}).get("rows") or []
    panels = 4 + (1 if live_rows else 0)
    fig, axes = plt.subplots(1, panels, figsize=(4.4 * panels, 4.6))

    def bars(ax: Any, labels: list[str], series: list[tuple[str, list[float | None], str]],
             ylabel: str, title: str, log: bool = True) -> None:
        """One quantity per panel, in one unit (several series only of that unit)."""
        width = 0.8 / max(len(series), 1)
        for i, (name, vals, color) in enumerate(series):
            xs = [x - 0.4 + (i + 0.5) * width for x in range(len(labels))]
            shown = [v if v is not None and v > 0 else 0 for v in vals]
            ax.bar(xs, shown, width, label=name, color=color)
            for x, v in zip(xs, vals, strict=False):
                if v is not None and v > 0:
                    ax.text(x, v, f"{v:,.1f}", ha="center", va="bottom", fontsize=7)
                elif v is not None:  # nothing measurable: say so at the bottom of the axes
                    ax.annotate("~0", (x, 0.02), xycoords=("data", "axes fraction"),
                                ha="center", fontsize=7)
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, rotation=20, ha="right", fontsize=8)
        if log:
            ax.set_yscale("log")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{title}\n(lower is better)", fontsize=9)
        if len(series) > 1:
            ax.legend(fontsize=7)

    nat = [r for r in res.get("native", {}).get("rows") or [] if r.get("min_cycles_per_call")]
    bars(axes[0], [r["variant"] for r in nat], [("cycles/call", [r["min_cycles_per_call"] for r in nat],
                                                 "#1f77b4")],
         "TSC cycles per call", "native, real hardware: user-mode toy kernel")
    uni = (res.get("unicorn", {}).get("bench_mode") or {}).get("rows") or []
    uni = [r for r in uni if r["variant"] != "uninstrumented"]
    bars(axes[1], [r["variant"] for r in uni],
         [("+emulated instructions/hit", [r.get("insns_per_hit") for r in uni], "#2ca02c")],
         "added instructions per hit (emulated)", "unicorn (bench mode)", log=False)
    qem = (res.get("qemu", {}).get("bench_mode") or {}).get("rows") or []
    qem = [r for r in qem if r["variant"] != "uninstrumented"]
    bars(axes[2], [r["variant"] for r in qem],
         [("+emulated cycles/hit", [r.get("cycles_per_hit") for r in qem], "#9467bd")],
         "added emulated cycles per hit", "QEMU TCG (bench mode): emulated, not hardware")
    variants = list(dict.fromkeys([r["variant"] for r in uni] + [r["variant"] for r in qem]))

    def ns(rows: list[dict[str, Any]]) -> list[float | None]:
        by = {r["variant"]: r.get("wall_ns_per_hit") for r in rows}
        return [by.get(v) for v in variants]

    bars(axes[3], variants, [("unicorn", ns(uni), "#2ca02c"), ("QEMU TCG", ns(qem), "#9467bd")],
         "added host nanoseconds per hit", "emulators: host time")
    if live_rows:
        rows = [r for r in live_rows if r.get("overhead") is not None]
        bars(axes[4], [r["variant"] for r in rows],
             [("+emulated cycles/getpid", [r["overhead"] for r in rows], "#8c564b")],
             "added emulated cycles per getpid", "live Debian 6.1 under TCG: emulated", log=False)
    save(fig, path)


# --- trap dispatch against the number of routes (for the batch benchmark) ---------------------
def route_sites(t: Any, count: int, avoid: int) -> list[int]:
    """``count`` instruction starts in core kernel text, past each function's first
    instruction, where the kernel lets a trap route go (no hazard), none within 16
    bytes of ``avoid``: idle routes, never hit (no int3 is written there)."""
    funcs = sorted((f for f in t.image.functions if t.text[0] <= f.address < t.text[1]
                    and f.size > 16), key=lambda f: f.address)
    step = max(1, len(funcs) // max(count // 8, 1))
    sites: list[int] = []
    for f in funcs[::step]:
        code = t.read(f.address, min(f.size, 256))
        insns = list(t.arch.decode(code, f.address))[1:]
        sites += [i.address for i in insns
                  if not t.arch.is_breakpoint(i) and i.mnemonic not in ("int3", "nop")
                  and abs(i.address - avoid) >= 16][:16]
        if len(sites) >= 2 * count:
            break
    ok: list[int] = []
    for i in range(0, len(sites), 4096):
        chunk = sites[i:i + 4096]
        ok += [a for a, h in zip(chunk, t.text_hazards([(a, 1) for a in chunk]), strict=True)
               if not h]
    if len(ok) < count:
        raise Skip(f"only {len(ok)} sites for idle trap routes found")
    return ok[:count]


def trap_dispatch(m: Any, routes: int, ctx: Context) -> dict[str, Any]:
    """Emulated cycles per getpid with ksim's trap on DISPATCH_FUNCTION: with its own route
    only, then with ``routes`` more installed (idle sites), interleaved rounds; the
    overhead per hit is the difference to the uninstrumented call."""
    import json

    t = m.target
    arm64 = t.arch.name == "aarch64"
    prog = _guest_program("arm64" if arm64 else "x86_64")
    calls, repeats, rounds = ctx.pick((50_000, 5, 3), (20_000, 3, 2), (500, 1, 1))
    if arm64:
        calls, repeats, rounds = ctx.pick((20_000, 3, 3), (5_000, 3, 2), (500, 1, 1))
    cmd = f"{prog} {calls} {repeats}"

    def cycles() -> float:
        r = t.run(while_cmd=cmd, timeout=1800)
        return float(json.loads(r.output.strip().splitlines()[-1])["min_cycles_per_call"])

    function = DISPATCH_FUNCTION_ARM64 if arm64 else DISPATCH_FUNCTION
    point = m.entry_point(function)
    sites = route_sites(t, routes, point.address)
    idle = t.alloc_code(16)
    counter = m.malloc(8)
    base = [cycles()]
    h = m.insert_snippet(point, counter.atomic_assign(counter + 1), splice="trap")
    one: list[float] = []
    many: list[float] = []
    try:
        for _ in range(rounds):
            one.append(cycles())
            t.apply(Change(routes=tuple((site, idle) for site in sites)))
            many.append(cycles())
            t.apply(Change(routes=tuple((site, 0) for site in sites)))
        hits = m.read(counter)
    finally:
        m.remove_snippet(h)
        t.free_code(idle)
        m.free(counter)
    # the second baseline once the trap is out (it was measured with the trap still in)
    if rounds > 1:
        base.append(cycles())
    if hits < calls * repeats * 2 * rounds:  # each timed getpid calls the function once
        raise KsimError(f"trap dispatch: {hits} hits of {function} for "
                        f"{calls * repeats * 2 * rounds} timed getpid calls")
    b = min(base)
    rows = [{"routes": 1, "cycles": min(one), "overhead": min(one) - b},
            {"routes": routes + 1, "cycles": min(many), "overhead": min(many) - b}]
    ratio = rows[1]["overhead"] / rows[0]["overhead"] if rows[0]["overhead"] > 0 else None
    return {"rows": [{"routes": 0, "cycles": b, "overhead": 0.0}] + rows, "ratio": ratio,
            "routes": routes + 1, "rounds": rounds, "hits": hits, "calls": calls, "repeats": repeats,
            "function": function,
            "unit": "CNTVCT_EL0 ticks (TCG)" if arm64 else "emulated rdtsc cycles (TCG)"}
