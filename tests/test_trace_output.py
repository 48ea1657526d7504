"""Maps as ``ksim trace`` lays them out and prints them: the kernel's hash (a
snippet) equals the client's, the client finds what the kernel claims, and the
text is bpftrace's language's format, byte for byte."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st
from snippet_machine import Machine, random_regs

from ksim.arch import get_arch
from ksim.snippets.ast import Const, Var
from ksim.trace.maps import (
    PROBES,
    MapLayout,
    MapType,
    MapUse,
    Table,
    hash_keys,
    hash_tree,
    layout_for,
    size_map,
)
from ksim.trace.output import MapPrinter, hist_label, hist_text, lhist_rows
from ksim.trace.session import bucket

ARCH = get_arch("x86_64")
CODE, DATA, STACK = 0x1000000, 0x2000000, 0x3000000
_machine: Machine | None = None


def machine() -> Machine:
    global _machine
    if _machine is None:
        _machine = Machine({CODE: 0x10000, DATA: 0x1000, STACK: 0x10000})
    return _machine


@settings(max_examples=60)
@given(st.lists(st.integers(0, (1 << 64) - 1), min_size=1, max_size=3))
def test_the_kernel_hashes_keys_as_the_client_does(keys):
    m = machine()
    code = ARCH.compile_snippets([Var(DATA).assign(hash_tree([Const(k) for k in keys]))], CODE,
                                 live=frozenset(ARCH.all_regs), abi=None)
    m.run(code, CODE, random_regs(random.Random(0), STACK + 0x8000))
    assert m.u64(DATA) == hash_keys(keys)


def memory_table(mtype: MapType, use: MapUse | None = None,
                 max_map_keys: int | None = None) -> tuple[Table, bytearray]:
    heap = bytearray(1 << 20)
    top = [0x1000]

    def alloc(size: int) -> int:
        top[0] += size
        return top[0] - size

    sizing = size_map(use or MapUse(computed=True, kernel_computed=True), max_map_keys)
    lay = layout_for(mtype, alloc, [], sizing)
    table = Table(lay, lambda a, n: bytes(heap[a:a + n]),
                  lambda a, d: heap.__setitem__(slice(a, a + len(d)), d))
    return table, heap


def test_the_client_finds_claims_and_merges_records():
    table, _ = memory_table(MapType("@m", ("int", "int"), "count"))
    lay = table.layout
    assert lay.slots & (lay.slots - 1) == 0 and lay.slots >= 4 * lay.capacity
    assert lay.probes == PROBES and lay.capacity == 4096
    records = {k: table.find(k, claim=True) for k in [(1, 2), (2, 1), (0, 0), (1 << 63, 5)]}
    assert list(records.values()) == [0, 1, 2, 3] and table.records_used() == 4
    assert table.find((1, 2), claim=False) == records[(1, 2)]
    assert table.find((9, 9), claim=False) is None
    for key, record in records.items():
        table.put(record, lay.present, 1)
        table.put(record, lay.value0, key[0] + 10)
    # a second record of one key (a claim race in the kernel) merges into the first
    table.find((7, 7), claim=True)
    for i, word in enumerate([2, 1, 1, 5]):
        table.put(4, i, word)
    entries = table.entries()
    assert entries[(2, 1)] == [12 + 5] and entries[(1, 2)] == [11] and len(entries) == 4
    table.delete((1, 2))
    assert (1, 2) not in table.entries() and table.find((1, 2), claim=False) == records[(1, 2)]


def test_a_full_map_hands_out_no_record_and_counts_what_it_lost():
    table, _ = memory_table(MapType("@m", ("int",), "count"), MapUse(computed=True,
                                                                         kernel_computed=True), 3)
    assert [table.find((k,), claim=True) for k in (5, 6, 7, 8)] == [0, 1, 2, None]
    assert table.find((6,), claim=True) == 1 and table.records_used() == 3
    table.count_lost()
    assert table.lost() == 1


def test_a_histogram_prints_as_bpftraces_language_does():
    lay = MapLayout(MapType("@usecs", (), "hist"), 0)
    values = [0] * 65
    for v in [0, 1, 1, 3, 9, 9, 9, 1500, -4]:
        values[bucket(lay, v)] += 1
    text = MapPrinter(lay).text({(): values})
    assert text == (
        "@usecs: \n"
        "(..., 0)               1 |@@@@@@@@@@@@@@@@@                                   |\n"
        "[0]                    1 |@@@@@@@@@@@@@@@@@                                   |\n"
        "[1]                    2 |@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@                  |\n"
        "[2, 4)                 1 |@@@@@@@@@@@@@@@@@                                   |\n"
        "[4, 8)                 0 |                                                    |\n"
        "[8, 16)                3 |@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@|\n"
        "[16, 32)               0 |                                                    |\n"
        "[32, 64)               0 |                                                    |\n"
        "[64, 128)              0 |                                                    |\n"
        "[128, 256)             0 |                                                    |\n"
        "[256, 512)             0 |                                                    |\n"
        "[512, 1K)              0 |                                                    |\n"
        "[1K, 2K)               1 |@@@@@@@@@@@@@@@@@                                   |\n")
    assert MapPrinter(lay).json({(): values})[0] == {"max": -1, "count": 1}
    assert [hist_label(p) for p in (0, 9, 10, 21, 35, 42)] == ["1", "512", "1K", "2M", "32G", "4T"]


def test_a_linear_histogram_has_open_ends():
    rows = lhist_rows([1, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 4], 0, 10240, 1024)
    assert [label for label, _, _ in rows] == [
        "(..., 0)", "[0, 1K)", "[1K, 2K)", "[2K, 3K)", "[3K, 4K)", "[4K, 5K)", "[5K, 6K)",
        "[6K, 7K)", "[7K, 8K)", "[8K, 9K)", "[9K, 10K)", "[10K, ...)"]
    assert rows[2][1] == {"min": 1024, "max": 2047} and rows[-1][1] == {"min": 10240}
    assert hist_text(rows[:1]).startswith("(..., 0)               1 |@@@@")


def test_maps_print_sorted_by_value_with_names_for_symbols():
    lay = MapLayout(MapType("@", ("ksym", "int"), "count"), 0, names=["vfs_read", "vfs_write"])
    text = MapPrinter(lay).text({(0, 3): [5], (1, (1 << 64) - 1): [2], (0, 1): [9]})
    assert text == "@[vfs_write, -1]: 2\n@[vfs_read, 3]: 5\n@[vfs_read, 1]: 9\n"
    mins = MapLayout(MapType("@m", ("int",), "min"), 0)
    from ksim.trace.maps import encode_extreme

    text = MapPrinter(mins).text({(1,): [encode_extreme("min", 7)], (2,): [encode_extreme("min", -3)]})
    assert text == "@m[2]: -3\n@m[1]: 7\n"
