"""batch: time to insert and to remove entry probes on N functions at once.

For each target, the first N functions (by address) whose entry ksim can splice
get an entry counter each (``insert_snippet`` one by one, then ``remove_snippet``
one by one), for growing N up to every spliceable function of the toy kernel.
Each insertion is the whole path: analysis (cached after the first use), plan,
patch-area allocation, and the target's poke (unicorn: memory writes; QEMU: the
gdbstub; live: kerninstd's int3-protocol text poke over TCP).  After removal the
text is compared with the original bytes.

On the live testbed kernel the functions come from a subsystem that is idle once
booted (ACPI's ``acpi_ut_*`` utilities and others named in LIVE_PREFIXES), and N
stays in the hundreds: every insertion is a few daemon round trips (~10 ms each),
so all ~50,000 functions would take hours.
"""

from __future__ import annotations

import time
from typing import Any

from ksim.bench.common import Context, Section, Table, attempt, pyplot, save
from ksim.errors import KsimError

NAME = "batch"
TITLE = "Insert and remove entry probes on N functions"
LIVE_PREFIXES = ("acpi_ut_", "acpi_ns_", "acpi_ds_", "acpi_ex_", "acpi_ps_", "acpi_tb_")


def _candidates(m: Any, names: list[str], want: int, policy: str) -> list[Any]:
    out: list[Any] = []
    for name in names:
        if len(out) >= want:
            break
        try:
            point = m.entry_point(name)
        except Exception:  # noqa: BLE001 - not analysable: not a candidate
            continue
        if m.can_insert(point, policy) is None:
            out.append(point)
    return out


def _batch(m: Any, points: list[Any], policy: str) -> dict[str, Any]:
    counter = m.malloc(8)
    snippet = counter.atomic_assign(counter + 1)
    before = {p.address: m.copy_from_kernel(p.address, 16) for p in points}
    t0 = time.perf_counter()
    handles = [m.insert_snippet(p, snippet, splice=policy) for p in points]
    t_insert = time.perf_counter() - t0
    tactics: dict[str, int] = {}
    for tactic, _n in m.splices().values():
        tactics[tactic] = tactics.get(tactic, 0) + 1
    t0 = time.perf_counter()
    for h in handles:
        m.remove_snippet(h)
    t_remove = time.perf_counter() - t0
    restored = all(m.copy_from_kernel(a, 16) == b for a, b in before.items())
    m.free(counter)
    n = len(points)
    return {"n": n, "insert_s": t_insert, "remove_s": t_remove,
            "insert_ms_per_probe": 1e3 * t_insert / n if n else None,
            "remove_ms_per_probe": 1e3 * t_remove / n if n else None,
            "tactics": tactics, "text_restored": restored}


def _target(spec: str, ns: list[int | None], policies: tuple[str, ...],
            names: list[str] | None = None, bar: Any = None) -> dict[str, Any]:
    from ksim.kapi import Manager

    runs = []
    with Manager.attach(spec) as m:
        if names is None:
            names = [f.name for f in sorted(m.target.image.functions, key=lambda f: f.address)]
        t0 = time.perf_counter()
        pool = {pol: _candidates(m, names, max(n or len(names) for n in ns), pol) for pol in policies}
        analyse_s = time.perf_counter() - t0
        for pol in policies:
            for n in ns:
                points = pool[pol][:n] if n else pool[pol]
                rec = _batch(m, points, pol)
                rec["policy"] = pol
                runs.append(rec)
                if bar is not None:
                    bar.advance(note=f"{spec} {pol} N={rec['n']}")
    return {"runs": runs, "candidates": {p: len(v) for p, v in pool.items()},
            "first_analysis_s": analyse_s}


def run(ctx: Context) -> Section:
    import shutil

    toy_ns: list[int | None] = ctx.pick([10, 30, 100, 200, None], [10, 100, None], [3, 10])
    live_ns: list[int | None] = ctx.pick([10, 30, 100, 300], [10, 30, 100], [])
    targets: list[tuple[str, str, list[int | None], tuple[str, ...], Any]] = [
        ("unicorn", "unicorn:toy", toy_ns, ("auto", "trap"), None)]
    notes: list[str] = []
    if shutil.which("qemu-system-x86_64"):
        targets.append(("qemu", "qemu:toy", toy_ns, ("auto", "trap"), None))
    else:
        notes.append("qemu: skipped: qemu-system-x86_64 is not installed")
    live = _live_spec(ctx)
    if isinstance(live, str):
        notes.append(f"live: skipped: {live}")
    elif live_ns:
        targets.append(("live", live[0], live_ns, ("auto",), live[1]))
    results: dict[str, Any] = {}
    total = sum(len(ns) * len(pols) for _l, _s, ns, pols, _n in targets)
    with ctx.bar(total, "batch") as bar:
        for label, spec, ns, pols, names in targets:
            done = attempt(label, results, notes, _target, spec, ns, pols, names, bar)
            if done is not None:
                results[label] = done
    if isinstance(live, str):
        results["live"] = {"skipped": live}
    rows = []
    for label, r in results.items():
        for run_ in r.get("runs", []):
            rows.append([label, run_["policy"], run_["n"], round(run_["insert_s"], 3),
                         round(run_["remove_s"], 3), round(run_["insert_ms_per_probe"] or 0, 3),
                         round(run_["remove_ms_per_probe"] or 0, 3),
                         " ".join(f"{k}:{v}" for k, v in sorted(run_["tactics"].items())),
                         run_["text_restored"]])
    table = Table("Insert / remove N entry probes (one counter snippet each)",
                  ["target", "policy", "N", "insert s", "remove s", "ms/insert", "ms/remove",
                   "tactics", "text restored"], rows)
    notes.append("N = all: every function of the toy kernel whose entry the policy can splice; "
                 "the first use of each function also pays for its analysis "
                 "(first_analysis_s: analysing the candidates before timing)")
    return Section(results, [table], notes, {"toy_ns": toy_ns, "live_ns": live_ns})


def _live_spec(ctx: Context) -> tuple[str, list[str]] | str:
    if ctx.smoke:
        return "smoke run: the live testbed is left alone"
    try:
        from live import testbed
    except ImportError as exc:
        return f"the live testbed is not part of this installation ({exc})"
    state = testbed.status()
    if not state.get("up"):
        return "the Linux testbed is not up (start it with `ksim testbed up`)"
    from ksim.kapi import Manager

    try:
        with Manager.attach(state["address"]) as m:
            funcs = sorted((f for f in m.target.image.functions
                            if f.name.startswith(LIVE_PREFIXES)), key=lambda f: f.address)
    except (OSError, KsimError) as exc:
        return f"the Linux testbed did not answer: {type(exc).__name__}: {exc}"
    return state["address"], [f.name for f in funcs]


def plot(section: dict[str, Any], path: str) -> None:
    plt = pyplot()
    res = section["results"]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for label, r in res.items():
        for pol in sorted({x["policy"] for x in r.get("runs", [])}):
            runs = [x for x in r["runs"] if x["policy"] == pol]
            ns = [x["n"] for x in runs]
            ax.plot(ns, [x["insert_s"] for x in runs], "o-", label=f"{label} {pol} insert")
            ax.plot(ns, [x["remove_s"] for x in runs], "x--", label=f"{label} {pol} remove")
            ax2.plot(ns, [x["insert_ms_per_probe"] for x in runs], "o-", label=f"{label} {pol} insert")
            ax2.plot(ns, [x["remove_ms_per_probe"] for x in runs], "x--", label=f"{label} {pol} remove")
    ax.set_xlabel("N functions")
    ax.set_ylabel("seconds for all N")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_title("Total time")
    ax.legend(fontsize=7)
    ax2.set_xlabel("N functions")
    ax2.set_ylabel("ms per probe")
    ax2.set_xscale("log")
    ax2.set_yscale("log")
    ax2.set_title("Per-probe cost")
    save(fig, path)
