"""``ksim verify`` on local processes: the toy kernel and the Debian vmlinux, the
verdict digest across worker counts, resuming from a results file, reproducers,
and the errors bad input gets (tests/test_verify_ray.py runs it on Ray)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest

from ksim.campaign import campaign, cases
from ksim.cli import main


def verify(capsys, *argv: str) -> tuple[int, dict]:
    """``ksim verify ARGV --json``: (exit status, the JSON it printed)."""
    status = main(["verify", *argv, "--json", "--no-progress"])
    out = capsys.readouterr().out
    return status, json.loads(out)


# --- the toy kernel --------------------------------------------------------------------
def test_toy_every_function(capsys, tmp_path):
    status, s = verify(capsys, "--image", "toy", "--cases", "2", "--seed", "5")
    assert status == 0, s
    assert s["engine"] == "local" and s["image"] == "toy"
    assert s["cases"] == 2 * s["points"] and s["points"] > 100
    assert s["non_equivalent"] == 0 and s["errors"] == 0
    assert s["compared"] == s["equivalent"] >= 0.8 * s["cases"]
    assert s["equivalent"] + s["refused"] == s["cases"]
    # the toy's trap path is refused by the blacklist, and says so
    assert s["refusals"] == {"Blacklisted": s["refused"]}
    # the same seed, one worker: the same verdicts; another seed: other cases
    status, one = verify(capsys, "--image", "toy", "--cases", "2", "--seed", "5", "--workers", "1")
    assert one["verdicts"] == s["verdicts"] and one["workers"] == 1
    _, other = verify(capsys, "--image", "toy", "--cases", "2", "--seed", "6")
    assert other["verdicts"] != s["verdicts"]


def test_toy_selection_and_text_summary(capsys):
    status = main(["verify", "--image", "toy", "--functions", "kmalloc,kmem_*,do_syscall_64+0x4",
                   "--cases", "3", "--no-progress"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "not equivalent         0" in out and "verdicts" in out
    head = out.splitlines()[0]
    points = int(head.split(" cases at ")[1].split()[0])
    assert head.split(": ")[1].startswith(f"{3 * points} cases")


def test_policies_and_snippets(capsys):
    for policy in ("trap", "jmp", "springboard"):
        status, s = verify(capsys, "--image", "toy", "--functions", "k*", "--splice", policy,
                           "--snippet", "empty")
        assert status == 0 and s["non_equivalent"] == 0, s
        assert set(s["tactics"]) <= {"trap", "jmp", "jmp+displace", "springboard"}
    _, s = verify(capsys, "--image", "toy", "--functions", "k*", "--splice", "trap")
    assert set(s["tactics"]) == {"trap"}


def test_points_of_other_kinds(capsys):
    """--points: a function's exits, block starts and call sites as well as its entry."""
    _, entry = verify(capsys, "--image", "toy", "--functions", "do_syscall_64")
    _, calls = verify(capsys, "--image", "toy", "--functions", "do_syscall_64", "--points",
                      "callsite")
    _, every = verify(capsys, "--image", "toy", "--functions", "do_syscall_64", "--points",
                      "entry,exit,block,callsite", "--cases", "2")
    assert entry["points"] == 1 and calls["points"] == 2  # call rel32, call [table]
    assert every["points"] >= 5 and every["cases"] == 2 * every["points"]
    _, sample = verify(capsys, "--image", "toy", "--points", "block", "--sample", "40")
    assert sample["points"] == sample["cases"] == 40
    status = main(["verify", "--image", "toy", "--points", "entry,middle", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert status == 2 and doc["error"] == "bad-case" and "'middle'" in doc["message"]


def test_a_moved_indirect_call_that_faults(capsys):
    """A moved call through memory reads its operand before it pushes, as the call
    does: when the read faults, the spliced run stops with the original's rsp (found
    by ksim verify --image toy --points callsite, when the moved form pushed first)."""
    for case in ("do_syscall_64+0xf:auto:counter:2754968963",   # call [rsi*8 + table], jmp
                 "e100_watchdog+0x2b:auto:counter:3318834349",  # call [rax + 0x10], trap
                 "vfs_write+0x27:auto:counter:3778606079"):     # call [rax + 8], springboard
        status, record = verify(capsys, "--image", "toy", "--case", case)
        assert record["status"] == "equivalent", record["diffs"]


# --- resuming, reproducers ----------------------------------------------------------------
def test_resume_skips_what_the_file_holds(capsys, tmp_path):
    results = tmp_path / "out" / "toy.jsonl"
    argv = ("--image", "toy", "--cases", "2", "--seed", "9", "--results", str(results))
    _, full = verify(capsys, *argv)
    lines = results.read_text().splitlines()
    assert len(lines) == full["cases"] == full["ran"]
    records = [json.loads(line) for line in lines]
    assert all(r["image"] == "toy" and r["status"] in ("equivalent", "refused") for r in records)
    # an interrupted run: half the lines, the last one cut short
    half = len(lines) // 2
    results.write_text("\n".join(lines[:half]) + "\n" + lines[half][: len(lines[half]) // 2])
    _, resumed = verify(capsys, *argv)
    assert resumed["resumed"] == half and resumed["ran"] == full["cases"] - half
    assert resumed["verdicts"] == full["verdicts"]
    again = [json.loads(line) for line in results.read_text().splitlines()[half + 1:]]
    assert len(again) == resumed["ran"]  # the cut line is left alone, the new ones follow it
    # nothing left to do
    _, done = verify(capsys, *argv)
    assert done["ran"] == 0 and done["resumed"] == full["cases"]
    assert done["verdicts"] == full["verdicts"]


def test_a_case_reruns_from_its_reproducer(capsys, tmp_path):
    results = tmp_path / "toy.jsonl"
    verify(capsys, "--image", "toy", "--functions", "do_*", "--cases", "2",
           "--results", str(results))
    records = [json.loads(line) for line in results.read_text().splitlines()]
    source = cases.image_source("toy")
    for record in records[:6]:
        line = campaign.reproducer(source, record["case"])
        argv = shlex.split(line)
        assert argv[:2] == ["ksim", "verify"] and "--case" in argv
        status, again = verify(capsys, *argv[2:])
        assert status == 0
        same = ("case", "status", "point", "tactic", "reason", "diffs", "executed", "exit")
        assert {k: again[k] for k in same} == {k: record[k] for k in same}
    # the text form says what happened at which point
    main(["verify", "--image", "toy", "--case", records[0]["case"]])
    out = capsys.readouterr().out
    assert records[0]["point"] in out and records[0]["status"] in out


def test_the_summary_names_each_non_equivalent_case(capsys):
    """A record that is not equivalent (written here as the harness would) is in
    the summary's failures with a reproducer, and makes the exit status 1."""
    source = cases.image_source("toy")
    bad = {"image": "toy", "case": "do_syscall_64:auto:counter:7", "status": "not-equivalent",
           "point": "do_syscall_64+0x0", "tactic": "jmp", "reason": "",
           "diffs": ["registers (original/spliced): rbx 0x1/0x2"], "executed": 3, "exit": None}
    good = dict(bad, case="do_syscall_64:auto:counter:8", status="equivalent", diffs=[])
    outcome = campaign.Outcome(source, {r["case"]: r for r in (bad, good)}, "local", 1,
                               order=[bad["case"], good["case"]])
    s = outcome.summary()
    assert (s["cases"], s["compared"], s["non_equivalent"], s["equivalent"]) == (2, 2, 1, 1)
    [failure] = s["failures"]
    assert failure["reproduce"] == "ksim verify --image toy --case do_syscall_64:auto:counter:7"
    assert "rbx" in failure["why"]
    # the digest does not depend on the order of the records
    assert campaign.digest([good, bad]) == campaign.digest([bad, good]) == s["verdicts"]


# --- the Debian kernel ----------------------------------------------------------------------
def test_debian_vmlinux_few_hundred_cases(capsys, debian_kernel):
    argv = ("--sample", "150", "--cases", "2", "--seed", "3")
    status, two = verify(capsys, *argv, "--workers", "2")
    assert status == 0, two["failures"]
    assert two["image"] == "debian" and two["cases"] == 300 and two["points"] == 150
    assert two["non_equivalent"] == 0 and two["errors"] == 0
    assert two["equivalent"] >= 0.8 * two["cases"]
    assert {"jmp", "jmp+displace"} <= set(two["tactics"])
    assert all(reason for reason in two["refusals"])
    _, one = verify(capsys, *argv, "--workers", "1")
    assert one["verdicts"] == two["verdicts"]
    assert (one["equivalent"], one["refused"]) == (two["equivalent"], two["refused"])


def test_debian_named_points(capsys, debian_kernel, tmp_path):
    """Names, NAME+OFFSET and a name several static functions carry (given with
    the function's address)."""
    status, s = verify(capsys, "--functions", "resched_cpu,resched_cpu+0x24,vfs_read,stop_nmi+5",
                       "--cases", "3")
    assert status == 0 and s["points"] == 4 and s["cases"] == 12, s
    # a static function's name that others share: its cases name it with its address
    from collections import Counter

    from ksim.image import load_kallsyms

    image = load_kallsyms(debian_kernel.kallsyms, debian_kernel.vmlinux)
    names = Counter(f.name for f in {f.address: f for f in image.functions}.values())
    shared = next(n for n, k in sorted(names.items()) if k > 1 and not n.startswith("_"))
    records = tmp_path / "shared.jsonl"
    status, s = verify(capsys, "--functions", shared, "--results", str(records))
    [record] = [json.loads(line) for line in records.read_text().splitlines()]
    assert record["case"].startswith(f"{shared}@0x"), record
    status, again = verify(capsys, "--case", record["case"])
    assert again["status"] == record["status"] and again["point"] == record["point"]


def test_debian_modules(capsys, debian_kernel):
    status, s = verify(capsys, "--image", "debian:e100.ko", "--cases", "2")
    assert status == 0 and s["image"] == "debian:e100.ko" and s["points"] > 50, s
    assert s["non_equivalent"] == 0 and s["equivalent"] >= 0.8 * s["cases"]
    status, s = verify(capsys, "--image", str(debian_kernel.ext4), "--sample", "100")
    assert status == 0 and s["cases"] == 100 and s["non_equivalent"] == 0, s
    status = main(["verify", "--image", "debian:nfs.ko", "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert status == 2 and doc["error"] == "image" and "debian:e100.ko" in doc["message"]


def test_debian_arm64(capsys, tmp_path):
    """Debian's arm64 kernel (a flat Image and its kallsyms table), where AArch64's
    differential rules are declared."""
    from ksim.bench import kernel as kmod

    try:
        kmod.debian_kernel("arm64")
    except kmod.KernelUnavailable as exc:  # pragma: no cover - no package registry
        pytest.skip(str(exc))
    results = tmp_path / "arm64.jsonl"
    status, s = verify(capsys, "--image", "debian-arm64", "--sample", "60", "--results",
                       str(results))
    if status == 2:  # no rules declared: the harness says so
        assert "differential" in s["message"], s
        return
    assert s["image"] == "debian-arm64" and s["cases"] == 60 and s["errors"] == 0, s
    record = json.loads(results.read_text().splitlines()[0])
    line = campaign.reproducer(cases.image_source("debian-arm64"), record["case"])
    assert line == f"ksim verify --image debian-arm64 --case {record['case']}"
    _, again = verify(capsys, *shlex.split(line)[2:])
    assert again["status"] == record["status"] and again["point"] == record["point"]


# --- bad input ----------------------------------------------------------------------------
@pytest.mark.parametrize("argv,code", [
    (["--functions", "no_such_function_xyz"], "unknown-symbol"),
    (["--functions", "no_such_*_xyz"], "unknown-symbol"),
    (["--functions", "do_syscall_64+0x99999"], "outside-text"),
    (["--functions", "kmalloc,"], "bad-case"),
    (["--functions", "do_syscall_64+012"], "point-syntax"),
    (["--case", "do_syscall_64:auto:counter"], "bad-case"),
    (["--case", "do_syscall_64:sideways:counter:1"], "bad-case"),
    (["--case", "do_syscall_64:auto:bignum:1"], "bad-case"),
    (["--case", "do_syscall_64:auto:counter:-1"], "bad-case"),
    (["--case", "do_syscall_64+0x99999:auto:counter:1"], "bad-case"),
    (["--case", "do_syscall_64@0x10:auto:counter:1"], "bad-case"),
    (["--case", "no_such_function_xyz:auto:counter:1"], "unknown-symbol"),
    (["--case", "do_syscall_64:auto:counter:1", "--functions", "kmalloc"], "bad-case"),
    (["--splice", "sideways"], "ksim"),
    (["--cases", "0"], "bad-case"),
    (["--workers", "0"], "bad-case"),
    (["--program", "x.bt", "--points", "exit"], "bad-case"),
    (["--functions", "do_syscall_64", "--cases", str(2**64 - 1)], "bad-case"),   # MemoryError
    (["--functions", "do_syscall_64,kmalloc", "--cases", "500001"], "bad-case"),
])
def test_bad_input_is_a_specific_error(capsys, argv, code):
    status = main(["verify", "--image", "toy", *argv, "--json", "--no-progress"])
    doc = json.loads(capsys.readouterr().out)
    assert status == 2 and doc["error"] == code, doc


def test_bad_image_path(capsys, tmp_path):
    status = main(["verify", "--image", str(tmp_path / "nope" / "vmlinux"), "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert status == 2 and doc["error"] == "image" and "no kernel image" in doc["message"]
    junk = tmp_path / "junk.elf"
    junk.write_bytes(b"not an elf")
    status = main(["verify", "--image", str(junk), "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert status == 2 and doc["error"] == "malformed-image", doc
    status = main(["verify", "--image", "toy", "--results", str(tmp_path), "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert status == 2 and doc["error"] == "results-file" and "directory" in doc["message"]


def test_arm64_runs_or_says_why(capsys):
    """AArch64 is checked once its architecture declares differential rules; until
    then the harness's refusal is the command's error."""
    status = main(["verify", "--image", "toy-arm64", "--functions", "kmalloc,kfree", "--json",
                   "--no-progress"])
    doc = json.loads(capsys.readouterr().out)
    if status == 2:
        assert "aarch64" in doc["message"] and "differential" in doc["message"], doc
    else:
        assert doc["cases"] == doc["points"] == 2 and doc["image"] == "toy-arm64", doc
        assert status == (1 if doc["non_equivalent"] or doc["errors"] else 0)


def test_a_program_bad_or_unsupported(capsys, tmp_path):
    prog = tmp_path / "p.bt"
    prog.write_text("tracepoint:sched:sched_switch { @ = count(); }")
    status = main(["verify", "--image", "toy", "--program", str(prog), "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert status == 2 and doc["error"] == "bad-case" and "tracepoint" in doc["message"]
    status = main(["verify", "--image", "toy", "--program", str(tmp_path / "none.bt"), "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert status == 2 and doc["error"] == "bad-case"


@pytest.mark.parametrize("source", ["/dev/zero", "long", "fifo"])
def test_a_program_longer_than_the_bound_or_a_fifo_is_a_bad_case(capsys, tmp_path, source):
    """/dev/zero was read until a MemoryError, a FIFO without a writer waited for one
    (the command hung): a file is read up to ksim trace's bound, a FIFO to its end."""
    from ksim.commands.trace import MAX_PROGRAM_BYTES

    if source == "long":
        path = tmp_path / "long.bt"
        path.write_text("kprobe:do_syscall_64 { @ = count(); }\n" + "\n" * MAX_PROGRAM_BYTES)
        source = str(path)
    elif source == "fifo":
        source = str(tmp_path / "fifo")
        os.mkfifo(source)
    status = main(["verify", "--image", "toy", "--program", source, "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert status == 2 and doc["error"] == "bad-case"
    assert (f"'{source}': longer than {MAX_PROGRAM_BYTES:,} bytes" in doc["message"]
            if "fifo" not in source else "nothing is spliced" in doc["message"]), doc


def test_a_program_points(capsys, tmp_path):
    prog = tmp_path / "p.bt"
    prog.write_text("BEGIN { @n = 0; }\nkprobe:do_syscall_64 { @[func] = count(); }\n"
                    "kretprobe:kmalloc { @r = count(); }\n")
    status, s = verify(capsys, "--image", "toy", "--program", str(prog), "--cases", "2")
    assert status == 0 and s["non_equivalent"] == 0, s
    # do_syscall_64's entry and every return of kmalloc
    assert s["points"] >= 2 and s["cases"] == 2 * s["points"]


def test_without_ray_cluster_names_the_extra(tmp_path):
    """Ray left out (its import fails, as where the extra is not installed)."""
    code = ("import sys; sys.modules['ray'] = None\n"
            "from ksim.cli import main\n"
            "sys.exit(main(['verify', '--image', 'toy', '--functions', 'do_syscall_64', "
            "'--cluster', '127.0.0.1:1', '--no-progress']))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "pip install 'ksim[cluster]'" in done.stderr


def test_the_benchmark_smoke(capsys, tmp_path):
    """``ksim bench verify`` (smoke: the toy kernel, local processes) writes a
    results document of the benchmarks' schema, every run with the same verdicts."""
    from ksim.bench.common import validate

    out = tmp_path / "verify.json"
    status = main(["bench", "verify", "--smoke", "--json", "--no-progress", "--output", str(out)])
    doc = json.loads(capsys.readouterr().out)
    assert status == 0 and validate(doc) == [], doc
    assert json.loads(out.read_text()) == doc
    entry = doc["benchmarks"]["verify"]
    rows = entry["results"]["rows"]
    assert [(r["engine"], r["workers"]) for r in rows] == [("local", 1), ("local", 2)]
    assert len({r["verdicts"] for r in rows}) == 1 and all(r["cases_per_second"] for r in rows)
