"""Latency histograms: ksim's hist() buckets against bpftrace's definition, value by
value, and -- on the live testbed -- what a kretprobe latency measures beside the
kernel's own cost of the call and beside bpftrace.

bpftrace's hist() (src/ast/passes/codegen_llvm.cpp, createLog2Function, at v0.17.0):
bucket 0 for a negative value, 1 for 0, else 2 + floor(log2 v), computed by shifting
by 16, 8, 4, 2 and 1 -- so 0.17 tops out at bucket 33 ([2G, 4G)) for every value
from 2**31 on; 0.20 (commit 006e68d0f, "hist: Support values creater than 4G") adds
the shift by 32.  Its output (src/output.cpp, hist_to_str) labels bucket i > 2
``[2**(i-2), 2**(i-1))`` (K, M, G, T every ten powers) and its JSON gives
``min = 2**(i-2)``, ``max = 2**(i-1) - 1``; bucket 0 is ``(..., 0)`` with ``max -1``,
1 is ``[0]``, 2 is ``[1]``.

The live test runs ``ksim.bench.latency``'s conditions (module doc there): the
latency program under ksim alone, bpftrace alone and both at once, and the workload
alone, over reads of /dev/zero of a few sizes.
"""

# ruff: noqa: F811  (pytest fixtures imported from ksim.live.testing are parameters here)
from __future__ import annotations

import pytest

from ksim.commands.trace import trace
from ksim.live.testing import testbed  # noqa: F401
from ksim.trace.output import hist_rows

#: values around every edge that matters: sign, 0, 1, small powers of two and their
#: neighbours, 1023/1024 (the K label), 2**31 and 2**32 (where 0.17's shifts end),
#: and the ends of the 64-bit range
VALUES = (-(1 << 63), -1000, -1, 0, 1, 2, 3, 4, 5, 7, 8, 1000, 1023, 1024, 1025,
          (1 << 20) - 1, 1 << 20, (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 32,
          (1 << 40) + 5, (1 << 62), (1 << 63) - 1)


def bpftrace_log2(v: int, shifts: tuple[int, ...]) -> int:
    """bpftrace's createLog2Function, step by step: ``shifts`` (16, 8, 4, 2, 1) at
    v0.17.0, (32, 16, 8, 4, 2, 1) from v0.20.0."""
    if v < 0:                   # ICmpSLT on the 64-bit value
        return 0
    if v == 0:
        return 1
    result, n = 2, v
    for s in shifts:
        shift = s if n >= 1 << s else 0
        n >>= shift
        result += shift
    return result


V017 = (16, 8, 4, 2, 1)
V020 = (32, 16, 8, 4, 2, 1)


def bpftrace_label(i: int) -> str:
    """TextOutput::hist_to_str's label of bucket ``i``."""
    def power(p: int) -> str:
        for suffix, at in (("T", 40), ("G", 30), ("M", 20), ("K", 10)):
            if p >= at:
                return f"{1 << (p - at)}{suffix}"
        return str(1 << p)

    return {0: "(..., 0)", 1: "[0]", 2: "[1]"}.get(i) or f"[{power(i - 2)}, {power(i - 1)})"


def bpftrace_bounds(i: int) -> dict[str, int]:
    """JsonOutput::hist_to_str's bounds of bucket ``i`` (64-bit shifts, as from v0.20)."""
    return {0: {"max": -1}, 1: {"min": 0, "max": 0}, 2: {"min": 1, "max": 1}}.get(i) or \
        {"min": 1 << (i - 2), "max": (1 << (i - 1)) - 1}


def test_the_reference_is_bpftraces_log2():
    """The reference above is floor(log2) + 2 where 0.20 computes it, and 0.17 agrees
    with 0.20 below 2**32 and saturates at 33 from 2**31 on."""
    for v in VALUES:
        if v > 0:
            assert bpftrace_log2(v, V020) == 2 + v.bit_length() - 1
            if v < 1 << 32:
                assert bpftrace_log2(v, V017) == bpftrace_log2(v, V020)
            else:
                assert bpftrace_log2(v, V017) == 33


def test_hist_buckets_are_bpftraces_value_by_value(toy_path):
    """Each chosen value goes into a histogram of its own, once per hit of a kernel
    probe (the snippet's bucket code, on unicorn:toy) and once in END (the client's):
    each lands in bpftrace's bucket for it, printed with bpftrace's label and bounds;
    and the microsecond form, hist(v / 1000), divides as bpftrace does for v >= 0."""
    names = [f"@v{i}" for i in range(len(VALUES))]
    begin = " ".join(f"{n} = {v};" if v > -(1 << 63) else f"{n} = -9223372036854775807 - 1;"
                     for n, v in zip(names, VALUES, strict=True))
    kernel = " ".join(f"@k{i} = hist({n}); @u{i} = hist({n} / 1000);" for i, n in enumerate(names))
    end = " ".join(f"@e{i} = hist({n});" for i, n in enumerate(names))
    report, _ = trace(f"BEGIN {{ {begin} }} kprobe:vfs_read {{ @hits = count(); {kernel} }} "
                      f"END {{ {end} }}", "unicorn:toy", iterations=200)
    maps = report["maps"]
    hits = maps["@hits"]
    assert hits > 0
    for i, v in enumerate(VALUES):
        want = bpftrace_log2(v, V020)
        for name, count in ((f"@k{i}", hits), (f"@e{i}", 1)):
            assert maps[name] == [{**bpftrace_bounds(want), "count": count}], (v, name)
        if v >= 0:
            us = bpftrace_log2(v // 1000, V020)
            assert maps[f"@u{i}"] == [{**bpftrace_bounds(us), "count": hits}], v
        if v < 1 << 32:
            assert bpftrace_log2(v, V017) == want      # bpftrace 0.17 puts it there too
        values = [0] * 65
        values[want] = 1
        assert [label for label, _, _ in hist_rows(values)] == [bpftrace_label(want)]


# --- live: what a latency measures ---------------------------------------------------------
#: a small run of the benchmark's conditions: the smallest read, a middling one and a
#: large one, three rounds (medians of each run's fastest call)
LIVE_SIZES = (1, 4096, 65536)
LIVE_CALLS = 1000
LIVE_ROUNDS = 3
LIVE_CONDITIONS = ("none", "ksim", "bpftrace", "both")


@pytest.fixture(scope="module")
def latencies(testbed):
    from ksim.bench import latency
    from ksim.bench.common import Skip

    try:
        data = latency.measure(LIVE_SIZES, LIVE_CALLS, LIVE_ROUNDS, LIVE_CONDITIONS)
    except Skip as exc:
        pytest.skip(str(exc))
    return latency.summarize(data)


@pytest.mark.live
@pytest.mark.slow
def test_a_latency_grows_with_the_calls_own_cost_at_slope_one(latencies):
    """From the smallest read to the largest, each tool's latency grows by what the
    call itself grows by, as the workload times it with no probe anywhere: a clock
    running at another rate, or a hist() off by a bucket (a factor of 2), would make
    the slope 2 or 1/2; the noise of two fastest calls allows a tenth."""
    for tool in ("ksim", "bpftrace"):
        assert abs(latencies["slope"][tool] - 1) < 0.1, (tool, latencies["slope"])


@pytest.mark.live
@pytest.mark.slow
def test_ksims_latency_lies_between_the_kernels_measure_and_it_plus_ksims_cost(latencies):
    """ksim's latency of a call is the call (the kernel's own measure: the
    uninstrumented read less a read that fails before vfs_read) plus part of what
    ksim's two probes cost the call (the workload's view: instrumented less
    uninstrumented), never less than the call and never more than both."""
    for row in latencies["per_size"][:2]:        # the sizes where noise is below the cost
        assert row["kernel_ns"] <= row["ksim_ns"] <= row["kernel_ns"] + row["ksim_cost_ns"], row


@pytest.mark.live
@pytest.mark.slow
def test_both_at_once_bpftrace_measures_ksims_probes_and_ksim_not_bpftraces(latencies):
    """The reported difference: ksim's probes (an entry past the ftrace call, the
    exit at the ret) lie inside bpftrace's interval (its kprobe at the ftrace call,
    its kretprobe in the return trampoline), so with both in, bpftrace's latency grows
    by about what ksim's probes cost a call, and ksim's by about nothing of what
    bpftrace's cost.  That moves bpftrace's histogram of the shortest calls up (a
    bucket or two in the benchmark; at least half of one here), more than bpftrace's
    own probes do alone, and the largest reads' latencies hardly at all: an offset,
    not a factor.  The bounds allow the noise of differences of fastest calls on a
    shared machine: half of ksim's cost either way, a quarter of bpftrace's."""
    for row in latencies["per_size"][:2]:
        k_cost, b_cost = row["ksim_cost_ns"], row["bpftrace_cost_ns"]
        assert 0.5 * k_cost <= row["both_bpftrace_added_ns"] <= 1.5 * k_cost, row
        assert abs(row["both_ksim_added_ns"]) <= 0.25 * b_cost, row
    small, large = latencies["per_size"][0], latencies["per_size"][-1]
    assert small["bucket_shift_both"] >= 0.5 and small["log2_ratio_both"] >= 0.5, small
    assert small["bucket_shift_alone"] < small["bucket_shift_both"], small
    assert small["log2_ratio_alone"] < small["log2_ratio_both"], small
    # the largest reads: the same offset is a small fraction (their buckets may still
    # differ when the call's own time sits at a power of two)
    assert abs(large["log2_ratio_both"]) < 0.25, large
