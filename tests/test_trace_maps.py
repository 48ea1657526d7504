"""Maps hold what a valid program asks for (`ksim trace` on unicorn:toy).

A keyed map is sized from what keys it: exactly its constant keys when every key
is one (``@[func]`` over every function of the kernel), else ``max_map_keys`` (the
program's config block, ``--max-map-keys``, or bpftrace's default of 4,096).  A
full map keeps the first keys to arrive and counts the updates it had no room for.
Every count is checked against exact address hooks at the spliced points (the
oracle, independent of splicing), simulating the map's first-come rule where it
is full.
"""

from __future__ import annotations

import json
import time
from collections import Counter

import pytest
from test_trace import Hooks, pid_of

from ksim.cli import main
from ksim.commands.trace import trace
from ksim.snippets import ast
from ksim.trace.maps import (
    DEFAULT_MAX_MAP_KEYS,
    MIN_DEFAULT_KEYS,
    MapLayout,
    MapType,
    MapUse,
    place,
    size_map,
)


def first_come(updates, capacity: int) -> tuple[dict, int]:
    """(count per key kept, updates lost) of a map holding ``capacity`` keys that
    takes keys in the order updates arrive -- what the kernel's map must do."""
    kept: dict = {}
    lost = 0
    for key in updates:
        if key in kept or len(kept) < capacity:
            kept[key] = kept.get(key, 0) + 1
        else:
            lost += 1
    return kept, lost


def test_func_keys_over_every_function_fit_exactly(toy_path):
    """kprobe:* { @[func] = count(); }: one record per function probed (no more: the
    map is sized by its constant keys), each placed before the run (the snippet
    adds to a plain variable), every count equal to the oracle's."""
    hooks = Hooks(entry=lambda m, abi, site: site.function)
    seen = {}

    def attach(session):
        hooks(session)
        lay = session.layouts["@"]
        functions = {a.site.function for a in session.attached.values()}
        seen.update(capacity=lay.capacity, slots=lay.slots, functions=len(functions),
                    placed=len(session.placed["@"]))

    report, _ = trace("kprobe:* { @[func] = count(); }", "unicorn:toy", on_attach=attach, seed=3)
    assert report["probes"] > 200 and report["lost"] == {}
    assert report["maps"]["@"] == dict(Counter(hooks.seen["entry"]))
    assert seen["capacity"] == seen["functions"] == seen["placed"] == report["probes"]
    assert seen["slots"] == 0            # no kernel access computes a key: no index


def test_probe_keys_name_each_probe_a_wildcard_expands_to(toy_path):
    """``probe`` is bpftrace's name of each probe (kprobe:vfs_read, kprobe:vfs_read+17,
    kretprobe:vfs_read), not the attach point's text: one key, and one record, each."""
    hooks = Hooks(entry=lambda m, abi, site: site.function, insn=lambda m, abi, site: 1,
                  exit=lambda m, abi, site: 1)
    seen = {}

    def attach(session):
        hooks(session)
        seen["capacity"] = session.layouts["@"].capacity
        seen["probes"] = {a.site.probe for a in session.attached.values()}

    report, _ = trace("kprobe:vfs_*, k:vfs_read+17, kr:vfs_read { @[probe] = count(); }",
                      "unicorn:toy", on_attach=attach, seed=3)
    expected = {f"kprobe:{f}": n for f, n in Counter(hooks.seen["entry"]).items()}
    expected |= {"kprobe:vfs_read+17": len(hooks.seen["insn"]),
                 "kretprobe:vfs_read": len(hooks.seen["exit"])}
    assert report["maps"]["@"] == expected and expected["kretprobe:vfs_read"] > 0
    assert seen["capacity"] == len(seen["probes"]) >= len(expected)
    assert {"kprobe:vfs_read", "kprobe:vfs_read+17", "kretprobe:vfs_read"} <= seen["probes"]


def test_a_full_func_map_keeps_the_first_functions_to_arrive(toy_path):
    """max_map_keys below the functions probed: each function has a word the first
    hit claims a record through; the first 16 functions hit are kept with every
    hit counted, and every hit of the others is a lost update."""
    hooks = Hooks(entry=lambda m, abi, site: site.function)
    report, _ = trace("config = { max_map_keys = 16 }\nkprobe:* { @[func] = count(); }",
                      "unicorn:toy", on_attach=hooks, seed=3)
    kept, lost = first_come(hooks.seen["entry"], 16)
    assert report["maps"]["@"] == kept and len(kept) == 16
    assert report["lost"] == {"@": lost} and lost > 0
    assert report["lost_keys"] == [{"map": "@", "lost": lost, "keys": 16, "max_map_keys": 16,
                                    "full": True}]


def test_computed_keys_fill_the_map_in_the_order_they_arrive(toy_path):
    hooks = Hooks(entry=lambda m, abi, site: pid_of(m, abi))
    report, _ = trace("config = { max_map_keys = 3 }\nkprobe:vfs_read { @[pid] = count(); }",
                      "unicorn:toy", on_attach=hooks, seed=4)
    kept, lost = first_come(hooks.seen["entry"], 3)
    assert len(set(hooks.seen["entry"])) > 3 and lost > 0
    assert report["maps"]["@"] == {str(p): n for p, n in kept.items()}
    assert report["lost"] == {"@": lost}


def test_the_command_line_setting_wins_over_the_config_block(capsys, toy_path):
    program = "config = { max_map_keys = 3 }\nkprobe:vfs_read { @[pid] = count(); }"
    assert main(["trace", "-e", program, "--max-map-keys", "2", "--seed", "4"]) == 0
    out, err = capsys.readouterr()
    assert len([line for line in out.splitlines() if line.startswith("@[")]) == 2
    assert "WARNING: @: " in err and "lost: the map is full (max_map_keys=2)" in err
    with pytest.raises(SystemExit):
        main(["trace", "-e", program, "--max-map-keys", "0"])
    assert "expecting an integer from 1" in capsys.readouterr().err


def test_constant_and_computed_keys_of_one_map_share_records(toy_path):
    """@[1] is placed before the run, in the index the computed keys search: a hit
    whose arg2 & 3 is 1 adds to the same record."""
    hooks = Hooks(entry=lambda m, abi, site: m.reg("rdx") & 3)
    report, _ = trace("kprobe:vfs_read { @[1] = count(); @[arg2 & 3] = count(); "
                      "@x[arg2 & 3] = count(); @one = @[1]; }", "unicorn:toy", on_attach=hooks,
                      seed=5)
    seen = hooks.seen["entry"]
    expected = Counter(seen)
    assert report["maps"]["@x"] == {str(k): n for k, n in expected.items()} and expected[1]
    expected[1] += len(seen)
    assert report["maps"]["@"] == {str(k): n for k, n in expected.items()}
    assert report["maps"]["@one"] == expected[1]       # read back through the same record


def test_constant_keys_beyond_the_setting_are_searched_for(toy_path):
    """Two keys only: @[7] and the computed key of the first hit get the records, in
    the order they arrive; each constant key is searched for by its hash."""
    hooks = Hooks(entry=lambda m, abi, site: m.reg("rdx") & 3)
    report, _ = trace("config = { max_map_keys = 2 }\n"
                      "kprobe:vfs_read { @[7] = count(); @[8] = count(); @[arg2 & 3] = count(); }",
                      "unicorn:toy", on_attach=hooks, seed=5)
    updates = [k for v in hooks.seen["entry"] for k in (7, 8, v)]
    kept, lost = first_come(updates, 2)
    assert report["maps"]["@"] == {str(k): n for k, n in kept.items()}
    assert report["lost"] == {"@": lost} and lost > 0


def test_a_client_update_of_a_full_map_is_lost_not_an_error(capsys, toy_path):
    program = ("config = { max_map_keys = 2 }\nBEGIN { @[1] = 1; @[2] = 2; @[3] = 3; exit(); }\n"
               "END { @[4] = 4; }")
    assert main(["trace", "-e", program, "--json"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {"type": "map", "data": {"@": {"1": 1, "2": 2}}} in records
    lost = next(r for r in records if r["type"] == "lost_keys")
    assert lost["data"] == {"map": "@", "lost": 2, "keys": 2, "max_map_keys": 2, "full": True}


def test_maps_sized_by_default_shrink_to_fit_the_heap(toy_path):
    """Two histograms per pid, 4,096 keys each by default, are more than the toy
    kernel's 1 MiB data heap: the largest halves until both fit."""
    hooks = Hooks(entry=lambda m, abi, site: (pid_of(m, abi), m.reg("rdx")))
    sizes = {}

    def attach(session):
        hooks(session)
        sizes.update({name: lay.capacity for name, lay in session.layouts.items()})

    report, _ = trace("kprobe:vfs_read { @a[pid] = hist(arg2); @b[tid] = lhist(arg2, 0, 1000, 10); "
                      "@n[pid] = count(); }", "unicorn:toy", on_attach=attach, seed=2)
    assert MIN_DEFAULT_KEYS <= sizes["@a"] < DEFAULT_MAX_MAP_KEYS
    assert MIN_DEFAULT_KEYS <= sizes["@b"] < DEFAULT_MAX_MAP_KEYS
    assert sizes["@n"] == DEFAULT_MAX_MAP_KEYS
    pids = Counter(p for p, _ in hooks.seen["entry"])
    assert report["maps"]["@n"] == {str(p): n for p, n in pids.items()} and report["lost"] == {}
    assert {p: sum(b["count"] for b in buckets) for p, buckets in report["maps"]["@a"].items()} \
        == {str(p): n for p, n in pids.items()}


def test_a_setting_the_heap_cannot_hold_is_a_clear_error(capsys, toy_path):
    program = "config = { max_map_keys = 100000 }\nkprobe:vfs_read { @[pid] = hist(arg2); }"
    assert main(["trace", "-e", program]) == 2
    err = capsys.readouterr().err
    assert "the data heap has no room for the maps (@ " in err and "Traceback" not in err


def test_sizing_follows_what_keys_a_map():
    consts = MapUse(consts=dict.fromkeys((i,) for i in range(10_000)))
    assert size_map(consts, None).capacity == 10_000                  # more than the default
    assert size_map(consts, 20_000).capacity == 10_000                 # exact below the setting
    s = size_map(consts, 100)
    assert (s.capacity, s.direct, s.slots, s.place) == (100, 10_000, 0, False)
    computed = MapUse(consts={(1,): None}, computed=True, kernel_computed=True)
    s = size_map(computed, None)
    assert (s.capacity, s.flexible, s.place) == (DEFAULT_MAX_MAP_KEYS, True, True)
    assert s.slots >= 4 * s.capacity and s.slots & (s.slots - 1) == 0
    client_only = MapUse(consts={(1,): None}, computed=True)
    assert size_map(client_only, 8).slots == 0                        # the client indexes it


def test_placing_a_kernels_worth_of_constant_keys_is_linear():
    """35,000 functions' keys are placed in one pass over them (the client keeps the
    index): twice the keys take about twice the time, never the square."""
    def timed(n: int) -> float:
        lay = MapLayout(MapType("@", ("ksym",), "count"), 0,
                        size_map(MapUse(consts=dict.fromkeys((i,) for i in range(n))), None))
        start = time.perf_counter()
        placed, image = place(lay, ((i,) for i in range(n)))
        took = time.perf_counter() - start
        assert len(placed) == n == lay.capacity and len(image) == lay.size
        return took

    small, large = timed(35_000), timed(70_000)
    assert large < 4 * small + 0.05


def test_every_function_of_a_large_kernel_gets_its_record_in_a_few_requests(toy_path):
    """The session's allocation for 35,000 points (made up: the toy kernel has a few
    hundred functions) reads and writes the kernel a constant number of times, and
    the snippet of each point adds to its function's record directly."""
    from ksim.kapi import Manager
    from ksim.trace.compiler import Site
    from ksim.trace.parser import parse
    from ksim.trace.session import Attached, TraceSession

    with Manager.attach("unicorn:toy") as m:
        session = TraceSession(m, parse("kprobe:vfs_* { @[func] = count(); }"))
        probe = session.program.probes[0]
        for i in range(35_000):
            session.attached[(i, None)] = Attached(None, Site("entry", f"f{i}", "kprobe:vfs_*"),
                                                   [probe])
        calls = Counter()
        for op in ("copy_to_kernel", "copy_from_kernel", "alloc_data"):
            real = getattr(m, op)
            setattr(m, op, lambda *a, _real=real, _op=op: (calls.update([_op]), _real(*a))[1])
        start = time.perf_counter()
        session.allocate()
        took = time.perf_counter() - start
        lay = session.layouts["@"]
        assert lay.capacity == 35_000 and len(session.placed["@"]) == 35_000
        assert calls["copy_to_kernel"] == 1 and calls["copy_from_kernel"] == 0
        assert took < 10
        record = session.placed["@"][(session.name_index("f34999"),)]
        node = session.snippet(type("P", (), {"address": 34_999, "kind": None})())
        targets = [n for n in ast.walk(node) if isinstance(n, ast.AtomicAssign)]
        assert [t.target.address for t in targets] == [lay.records + 8 * (record * lay.stride + 2)]
        assert session.table("@").entries() == {}


@pytest.mark.parametrize("program, message", [
    ("config = { max_strlen = 0 }\nBEGIN { }", "max_strlen must be an integer from 1"),
    ("config = { nope = 1 }\nBEGIN { }", "Unrecognized config variable: nope"),
    ("config = { max_map_keys = 0 }\nBEGIN { }", "max_map_keys must be an integer from 1"),
    ("BEGIN { }\nconfig = { max_map_keys = 5 }", "a config block must come first"),
])
def test_config_blocks_are_checked(capsys, toy_path, program, message):
    assert main(["trace", "-e", program]) == 2
    err = capsys.readouterr().err
    assert message in err and "stdin:" in err


def test_after_detach_each_map_is_read_once_and_a_write_is_seen(toy_path):
    """Once the probes are gone nothing in the kernel changes a map: END's output and
    the report read each of its words once, not once each; a write of END's (the
    client's own) is seen by what reads the map after it, in the output and the
    report.  The counts are the oracle's."""
    hooks = Hooks(entry=lambda m, abi, site: m.reg("rdx"))       # arg2 (x86-64 toy)
    reads: list[tuple[int, int]] = []

    def attach(session):
        hooks(session)
        target = session.m.target
        read = target.read

        def counted(address: int, size: int, *args, **kwargs) -> bytes:
            if not session.handles:         # detached
                reads.append((address, size))
            return read(address, size, *args, **kwargs)

        target.read = counted

    report, out = trace("kprobe:vfs_read { @n[func] = count(); @last = arg2; } "
                        "END { print(@last); @last = 1000; print(@last); }",
                        "unicorn:toy", on_attach=attach, seed=3)
    calls = len(hooks.seen["entry"])
    assert calls > 0
    assert report["maps"]["@n"] == {"vfs_read": calls}
    last = hooks.seen["entry"][-1]
    assert last != 1000
    assert out.startswith(f"@last: {last}\n\n@last: 1000\n\n@last: 1000\n")
    assert report["maps"]["@last"] == 1000
    # every read after the probes went: the same (address, size) twice only across
    # END's write, which makes what was read before it stale
    assert reads and len(reads) - len(set(reads)) <= 2
