"""Kernel data in trace programs, on the toy kernel, each value against an oracle.

The types come from the toy's BTF (pahole -J over its DWARF); the oracle for every
field is the machine's own registers and memory read at the spliced point by an
exact-address unicorn hook, at offsets the C compiler itself computes from the
toy's headers (gcc's offsetof over images/toy/include, not the BTF the trace
compiler reads)."""

from __future__ import annotations

import subprocess
from collections import Counter
from pathlib import Path

import pytest
from test_trace import Hooks, run_trace

from ksim.trace.maps import signed

TOY_INCLUDE = Path(__file__).resolve().parent.parent / "images" / "toy" / "include"


@pytest.fixture(scope="module")
def offsets(tmp_path_factory) -> dict[str, int]:
    """offsetof and sizeof of the toy's structs, as gcc lays them out."""
    wanted = {"file.f_inode": "offsetof(struct file, f_inode)",
              "file.f_flags": "offsetof(struct file, f_flags)",
              "inode.i_ino": "offsetof(struct inode, i_ino)",
              "inode.name": "offsetof(struct inode, name)",
              "sizeof.inode": "sizeof(struct inode)",
              "task.pid": "offsetof(struct task_struct, pid)"}
    d = tmp_path_factory.mktemp("offsets")
    src = d / "off.c"
    body = "".join(f'  printf("{k} %zu\\n", (size_t){v});\n' for k, v in wanted.items())
    src.write_text('#include "toy.h"\nint printf(const char *, ...);\n'
                   '#define offsetof(t, m) __builtin_offsetof(t, m)\n'
                   f"int main(void) {{\n{body}  return 0;\n}}\n")
    subprocess.run(["gcc", "-std=gnu11", f"-I{TOY_INCLUDE}", "-o", str(d / "off"), str(src)],
                   check=True)
    out = subprocess.run([str(d / "off")], check=True, capture_output=True, text=True).stdout
    return {k: int(v) for k, v in (line.split() for line in out.splitlines())}


def test_kfunc_args_and_fields_are_the_registers_and_the_memory(toy_path, offsets):
    """args->NAME is the register of the parameter the BTF prototype names; ->, a
    nested ->, a char array read as a string: the bytes at gcc's offsets."""
    def at_entry(m, abi, site):
        f = m.reg("rdi")
        inode = m.read_u64(f + offsets["file.f_inode"])
        flags = int.from_bytes(m.read(f + offsets["file.f_flags"], 4), "little")
        name = m.read(inode + offsets["inode.name"], 24).split(b"\0")[0].decode()
        return m.reg("rdx"), flags, m.read_u64(inode + offsets["inode.i_ino"]), name

    hooks = Hooks(entry=at_entry)
    report = run_trace("kfunc:vfs_read { @count[args->count] = count(); "
                       "@flags[args->f->f_flags] = count(); "
                       "@ino[args->f->f_inode->i_ino] = count(); "
                       "@name[args->f->f_inode->name] = count(); }", hooks, seed=4)
    seen = hooks.seen["entry"]
    assert seen and report["maps"]["@count"] == {str(k): v for k, v in
                                                 Counter(s[0] for s in seen).items()}
    assert report["maps"]["@flags"] == {str(k): v for k, v in Counter(s[1] for s in seen).items()}
    assert report["maps"]["@ino"] == {str(k): v for k, v in Counter(s[2] for s in seen).items()}
    assert report["maps"]["@name"] == dict(Counter(s[3] for s in seen))


def test_casts_curtask_and_a_struct_the_program_defines(toy_path, offsets):
    """(struct file *)arg0 reads what the BTF says; a struct the program defines
    itself is laid out as C lays it out; curtask is the current task."""
    def at_entry(m, abi, site):
        f = m.reg("rdi")
        task = m.read_u64(abi.current_task.address)
        return (int.from_bytes(m.read(f + offsets["file.f_flags"], 4), "little"),
                int.from_bytes(m.read(task + offsets["task.pid"], 4), "little"))

    hooks = Hooks(entry=at_entry)
    report = run_trace("struct myfile { void *inode; void *ops; long pos; unsigned int count; "
                       "unsigned int flags; };\n"
                       "kprobe:vfs_read { @a[((struct file *)arg0)->f_flags] = count(); "
                       "@b[((struct myfile *)arg0)->flags] = count(); "
                       "@t[curtask->pid] = count(); @s = sizeof(struct inode); }", hooks, seed=2)
    seen = hooks.seen["entry"]
    flags = {str(k): v for k, v in Counter(s[0] for s in seen).items()}
    assert seen and report["maps"]["@a"] == flags == report["maps"]["@b"]
    assert report["maps"]["@t"] == {str(k): v for k, v in Counter(s[1] for s in seen).items()}
    assert report["maps"]["@s"] == offsets["sizeof.inode"]


def test_kretfunc_retval_is_typed_by_the_prototype(toy_path):
    hooks = Hooks(exit=lambda m, abi, site: signed(m.reg("rax")))
    report = run_trace("kretfunc:vfs_read { @sum = sum(retval); @n = count(); "
                       "@neg = sum(retval < 0); }", hooks, seed=3)
    values = hooks.seen["exit"]
    assert values and report["maps"]["@sum"] == sum(values)
    assert report["maps"]["@n"] == len(values)
    assert report["maps"]["@neg"] == sum(1 for v in values if v < 0)


def test_strings_as_keys_values_and_printf_arguments(toy_path, offsets):
    """str() of a kernel pointer, a string literal as a map value set in BEGIN and
    read by the kernel's probes, strings in printf, comm compared to a literal."""
    def at_entry(m, abi, site):
        inode = m.read_u64(m.reg("rdi") + offsets["file.f_inode"])
        return m.read(inode + offsets["inode.name"], 24).split(b"\0")[0].decode()

    hooks = Hooks(entry=at_entry)
    program = ('BEGIN { @label[1] = "reads"; } '
               'kprobe:vfs_read { $n = str(((struct file *)arg0)->f_inode->name); '
               '@[$n, @label[1]] = count(); printf("%s|%-6s|\\n", $n, @label[1]); '
               'if (comm == "nosuchtask") { @never = count(); } }')
    report = run_trace(program, hooks, seed=5)
    names = hooks.seen["entry"]
    assert names and report["maps"]["@"] == {f"{n},reads": c for n, c in Counter(names).items()}
    assert report["printf"] == [f"{n}|reads |\n" for n in names]
    assert "@never" not in report["maps"] or report["maps"]["@never"] == 0


def test_the_preprocessor_takes_the_btf_branch_and_its_defines(toy_path):
    hooks = Hooks(entry=lambda m, abi, site: m.reg("rdx"))
    program = ("#ifndef BPFTRACE_HAVE_BTF\n#include <linux/fs.h>\n#define BIG 1\n#else\n"
               "#define BIG (64 * 2)\n#endif\n"
               "kprobe:vfs_read /arg2 >= BIG/ { @big = count(); }")
    report = run_trace(program, hooks, seed=6)
    assert report["maps"].get("@big", 0) == sum(1 for v in hooks.seen["entry"] if v >= 128)


ARG_REGS = {"unicorn:toy": ("rdi", "rdx"), "unicorn:toy-arm64": ("x0", "x2")}


@pytest.mark.parametrize("spec", sorted(ARG_REGS))
def test_kfunc_fields_and_strings_on_both_architectures(toy_path, offsets, spec):
    """The same program on the x86-64 and the AArch64 toy (LP64 both: gcc's offsets
    hold for either), each against its machine's registers and memory."""
    from ksim.commands.trace import trace

    first, third = ARG_REGS[spec]

    def at_entry(m, abi, site):
        f = m.reg(first)
        inode = m.read_u64(f + offsets["file.f_inode"])
        name = m.read(inode + offsets["inode.name"], 24).split(b"\0")[0].decode()
        return m.reg(third), name

    hooks = Hooks(entry=at_entry)
    report, _ = trace("kfunc:vfs_read { @c[args->count] = count(); "
                      "@n[str(args->f->f_inode->name)] = sum(args->count); }", spec,
                      on_attach=hooks, seed=8)
    seen = hooks.seen["entry"]
    assert seen and report["maps"]["@c"] == {str(k): v for k, v in
                                             Counter(s[0] for s in seen).items()}
    sums: Counter = Counter()
    for count, name in seen:
        sums[name] += count
    assert report["maps"]["@n"] == dict(sums)


@pytest.mark.slow
def test_kfunc_fields_on_qemu_equal_the_emulator_s_oracle(toy_path, offsets):
    """qemu:toy runs the same seeded workload as unicorn:toy: the per-name sums of
    args->count under QEMU equal the values unicorn's exact-address hook read."""
    from ksim.commands.trace import trace

    def at_entry(m, abi, site):
        inode = m.read_u64(m.reg("rdi") + offsets["file.f_inode"])
        return m.reg("rdx"), m.read(inode + offsets["inode.name"], 24).split(b"\0")[0].decode()

    hooks = Hooks(entry=at_entry)
    program = "kfunc:vfs_read { @n[str(args->f->f_inode->name)] = sum(args->count); }"
    trace(program, "unicorn:toy", on_attach=hooks, seed=9)
    sums: Counter = Counter()
    for count, name in hooks.seen["entry"]:
        sums[name] += count
    report, _ = trace(program, "qemu:toy", seed=9)
    assert sums and report["maps"]["@n"] == dict(sums)


def test_kstack_on_the_toy_starts_with_the_point_and_its_caller(toy_path):
    """The toy's own unwinder (a guess walk, as Linux's unwind_guess): the first frame
    is the probed function, the second the return address the call left at the
    stack pointer (the machine's memory at the point is the oracle), and every frame
    is a return address just after a call instruction."""
    def at_entry(m, abi, site):
        return m.read_u64(m.reg("rsp"))

    hooks = Hooks(entry=at_entry)
    report = run_trace("kprobe:vfs_read { @[kstack(3)] = count(); @r[kstack(raw)] = count(); }",
                       hooks, seed=4)
    callers = Counter(hooks.seen["entry"])
    stacks = report["maps"]["@"]
    assert sum(stacks.values()) == sum(callers.values()) > 0
    from ksim.image import load_image

    image = load_image(toy_path)
    seen: Counter = Counter()
    for text, n in stacks.items():
        frames = text.strip().splitlines()
        assert len(frames) == 3 and frames[0].strip() == "vfs_read+0", text
        name, _, off = frames[1].strip().rpartition("+")
        seen[image.address_of(name) + int(off)] += n
    assert seen == callers
    for text in report["maps"]["@r"]:
        assert int(text.split()[0], 16) == image.address_of("vfs_read")


def test_kstack_where_the_frame_cannot_hold_pt_regs_is_refused_before_anything_is_spliced(
        capsys, toy_path):
    """AArch64's scratch slots are 16 bytes apart (sp stays 16-aligned): struct
    pt_regs's sp and x29 would fall in slots' second halves, which a snippet cannot
    write; kstack is refused there, by name, and the text is left as it was."""
    from ksim.cli import main

    assert main(["trace", "--image", "toy-arm64", "-e",
                 "kprobe:vfs_read { @[kstack] = count(); }"]) == 2
    err = capsys.readouterr().err
    assert "kstack: struct pt_regs's member at byte" in err and "stdin:1:21-27" in err


def test_buf_prints_bytes_as_bpftrace_s_percent_r(toy_path, offsets):
    """buf(p, n) and buf(array): the bytes at the address (the machine's memory is
    the oracle), printed by %r: printable ASCII as it is, other bytes as \\xNN."""
    def at_entry(m, abi, site):
        inode = m.read_u64(m.reg("rdi") + offsets["file.f_inode"])
        return m.read(inode + offsets["inode.name"], 24)

    def r(raw: bytes) -> str:
        return "".join(chr(b) if 32 <= b < 127 else f"\\x{b:02x}" for b in raw)

    hooks = Hooks(entry=at_entry)
    report = run_trace('kfunc:vfs_read { printf("%r|\\n", buf(args->f->f_inode->name, 12)); '
                       '@[buf(args->f->f_inode->name)] = count(); }', hooks, seed=6)
    names = hooks.seen["entry"]
    assert names and report["printf"] == [f"{r(n[:12])}|\n" for n in names]
    assert report["maps"]["@"] == dict(Counter(r(n) for n in names))
