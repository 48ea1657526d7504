"""Kernel images for the analysis tests.

``fixture_kernel()`` builds a small kernel-model ELF from the C below with the
toy kernel's code-generation flags (gcc -O2 -mcmodel=kernel -mno-red-zone
-fno-pic, linked at 0xffffffff81000000).  Its three switch functions are compiled
so that gcc emits each jump-table form analysis must recover:
``jmp *T(,%rdi,8)``, ``mov T(,%rdi,8),%rax; jmp *%rax`` and ``notrack jmp``.

``toy_kernel()`` is the bundled toy kernel when it can be built, else None.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

CFLAGS = ["-O2", "-mcmodel=kernel", "-mno-red-zone", "-fno-pic", "-fno-pie", "-ffreestanding",
          "-nostdlib", "-fno-stack-protector", "-fno-asynchronous-unwind-tables", "-fno-ipa-icf"]

SWITCH = r"""
extern void note(long);
int NAME(int x) {
    switch (x) {
    case 0: return 11; case 1: note(3); return 22; case 2: return 35; case 3: return 47;
    case 4: note(9); return 51; case 5: return 68; case 6: return 71; case 7: return 89;
    case 8: return 93; default: return -1;
    }
}
"""

MAIN = r"""
#define noinline __attribute__((noinline))
struct task { int pid; long state; struct task *next; };
long counter;
struct task tasks[4];
long (*hook)(long);

noinline void note(long v) { counter += v; asm volatile("" ::: "memory"); }
noinline long add3(long a, long b, long c) { return a + b * c; }
noinline long sum_list(struct task *t) {
    long s = 0;
    for (; t; t = t->next) { if (t->state < 0) break; s += t->pid; }
    return s;
}
noinline long tail_caller(long a) { if (a > 5) return add3(a, 1, 2); note(a); return 0; }
noinline long indirect_caller(long a) { return hook(a) + 1; }
noinline long keeps(long a, long b) {
    long x = add3(a, b, 3);
    long y = add3(b, a, x);
    return x * y + a;
}
noinline __attribute__((noreturn)) void halt(void) { for (;;) asm volatile("hlt"); }
noinline long checked(long a) { if (a < 0) halt(); return a * 3; }
int classify(int), classify_reg(int), classify_notrack(int);
void _start(void) {
    long r = 0;
    for (int i = 0; i < 10; i++) r += classify(i) + classify_reg(i) + classify_notrack(i);
    r += sum_list(tasks) + tail_caller(r) + indirect_caller(r) + keeps(r, 2) + checked(r);
    note(r);
    halt();
}
"""

UNITS = {
    "main.c": (MAIN, []),
    "sw_mem.c": (SWITCH.replace("NAME", "classify"), ["-fcf-protection=none"]),
    "sw_reg.c": (SWITCH.replace("NAME", "classify_reg"), ["-fcf-protection=none", "-mindirect-branch-register"]),
    "sw_notrack.c": (SWITCH.replace("NAME", "classify_notrack"), ["-fcf-protection=branch"]),
}

#: value of the absolute symbol KSIM_TEST_ABS the fixture defines at link time
ABS_VALUE = 0x2A8

#: functions of the fixture with a jump table
TABLE_FUNCTIONS = ("classify", "classify_reg", "classify_notrack")


def fixture_kernel() -> str:
    """Path of the fixture kernel (built once per content, cached in the temp dir)."""
    digest = hashlib.sha256(repr((CFLAGS, UNITS, ABS_VALUE)).encode()).hexdigest()[:16]
    out_dir = Path(tempfile.gettempdir()) / f"ksim-analysis-kernel-{digest}"
    elf = out_dir / "kernel.elf"
    if elf.exists():
        return str(elf)
    work = Path(tempfile.mkdtemp(prefix="ksim-analysis-build-"))
    try:
        objs = []
        for name, (src, flags) in UNITS.items():
            (work / name).write_text(src)
            obj = work / (name[:-2] + ".o")
            subprocess.run(["gcc", *CFLAGS, *flags, "-c", str(work / name), "-o", str(obj)],
                           check=True, capture_output=True)
            objs.append(str(obj))
        subprocess.run(["ld", "-nostdlib", "-static", "-Ttext=0xffffffff81000000",
                        f"--defsym=KSIM_TEST_ABS={ABS_VALUE:#x}",
                        "-o", str(work / "kernel.elf"), *objs], check=True, capture_output=True)
        (work / "main.o").rename(work / "module.ko")  # a relocatable object, as a module would be
        out_dir.mkdir(parents=True, exist_ok=True)
        for f in ("module.ko", "kernel.elf"):  # kernel.elf last: its presence means "complete"
            shutil.copy(work / f, out_dir / f".{f}.tmp")
            os.replace(out_dir / f".{f}.tmp", out_dir / f)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return str(elf)


def fixture_module() -> str:
    """A relocatable object (the fixture's main unit), laid out like a .ko."""
    return str(Path(fixture_kernel()).with_name("module.ko"))


def toy_kernel() -> str | None:
    """The bundled toy kernel's path, or None while it cannot be built."""
    try:
        from ksim import images

        return str(images.path("toy"))
    except Exception:  # not there yet, or its build fails: the fixture stands in
        return None


def kernels() -> list[str]:
    """Every kernel the structural tests run on."""
    out = [fixture_kernel()]
    toy = toy_kernel()
    if toy:
        out.append(toy)
    return out
