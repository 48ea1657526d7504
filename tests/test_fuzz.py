"""The fuzz tier: generated inputs to what reads untrusted text, each bounded in time.

Every input ends in ksim's own error or in success -- never another exception, a
hang or unbounded memory -- and a refusal changes nothing:

* ``ksim trace``'s parser and analysis (``parse`` + ``analyse``) over programs a
  grammar of bpftrace's language makes (probes, attach points, builtins, operators,
  strings and printf formats, casts, fields, maps, preprocessor lines), the same
  programs mutated, a soup of the language's tokens, and plain random text;
* accepted programs attached to unicorn:toy, run over a short workload and
  detached: a refusal leaves the kernel's text, its splices and the data heap as
  they were, and so does a detach;
* the snippets' check over random and deep or shared (DAG) trees;
* kerninstd's wire protocol: frame headers, bodies of random and mutated frames,
  and every op's fields with values of every JSON type.

ELF loading is fuzzed elsewhere.  The sizes below keep the file well under a
minute; ``--hypothesis-profile=long`` does not raise them (each test states its
own ``max_examples``).
"""

from __future__ import annotations

import json
import math
import struct

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from ksim.errors import KsimError, ProtocolError, SnippetError
from ksim.live import protocol as wire
from ksim.trace.compiler import analyse
from ksim.trace.errors import TraceError
from ksim.trace.parser import PUNCT, parse


def bounded(examples: int) -> settings:
    """``examples`` examples, whatever the profile: the tier's time stays bounded."""
    return settings(max_examples=examples, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])


# --- a grammar of the language ----------------------------------------------------------------
ATTACH = [
    "kprobe:vfs_read", "kprobe:vfs_*", "k:vfs_write", "kprobe:vfs_read+0", "kprobe:vfs_read+4",
    "kprobe:vfs_read+0x3", "kretprobe:vfs_read", "kr:vfs_llseek", "kretprobe:vfs_*",
    "kprobe:tcp_sync_mss", "kprobe:kmem_cache_*", "kprobe:no_such_function", "kprobe:*x*",
    "kfunc:vfs_read", "kretfunc:vfs_read", "fentry:vfs_write", "kfunc:mod:vfs_read",
    "tracepoint:syscalls:sys_enter_read", "tracepoint:sched:sched_switch", "t:syscalls:sys_exit_*",
    "tracepoint:block:*", "rawtracepoint:sched_switch", "rt:nope",
    "interval:ms:1", "interval:s:1", "i:1s", "interval:hz:0", "profile:hz:99", "profile:ms:1",
    "BEGIN", "END", "begin", "uprobe:/bin/sh:main", "usdt:x:y", "software:cpu-clock:1",
    "hardware:cycles:1", "watchpoint:0x10:8:w", "iter:task", "kprobe", "kprobe:", "nope:x",
]
BUILTINS = ["pid", "tid", "cpu", "nsecs", "retval", "func", "probe", "comm", "curtask", "args",
            "ppid", "pcomm", "kstack", "uid", "gid", "elapsed", "cgroup", "jiffies", "rand",
            "ncpus", "ustack", "username", "ctx", "cpid", "sarg0", "arg6", "TCP_ESTABLISHED",
            "BPFTRACE_HAVE_BTF", "nosuch", *(f"arg{i}" for i in range(6))]
TYPES = ["uint8", "int8", "uint16", "int32", "uint64", "u32", "s64", "unsigned long", "char *",
         "int *", "struct task_struct *", "struct file *", "struct sock *", "struct nosuch *",
         "struct ksim_rec", "bool", "void *", "const char *", "enum x", "string"]
FIELDS = ["pid", "comm", "parent", "f_flags", "f_path", "dentry", "d_name", "name", "x", "0",
          "args", "real_parent", "mm", "tgid", "__state"]
FORMATS = ["%d", "%i", "%u", "%x", "%X", "%o", "%c", "%s", "%%", "%-8d", "%08x", "%.3s", "%5.2u",
           "%lld", "%lu", "%hhx", "%r", "%f", "%p", "%*d", "%999999999d", "%.99999999999s",
           "%1024d", "%", "%k", "\\n", "\\t", "\\0", "\\\\", "\\\"", " ", "text", "\\x41"]
INTS = ["0", "1", "7", "42", "007", "010", "08", "0x10", "0X1f", "0x", "0x_", "1_000", "1e6",
        "2E3", "1e99999999", "18446744073709551615", "18446744073709551616", "9" * 60,
        "4294967296", "255", "-1", "9223372036854775808"]
OPERATORS = ["+", "-", "*", "/", "%", "&", "|", "^", "<<", ">>", "==", "!=", "<", "<=", ">",
             ">=", "&&", "||"]
STRINGS = ['""', '"a"', '"abc"', '"vfs_read"', '"%d"', '"a\\nb"', '"\\0"', '"\\x"', '"é"',
           '"' + "x" * 80 + '"', '"sshd"', '"%H:%M:%S"']


def _ints() -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from(INTS),
                     st.integers(0, 2**66).map(str), st.integers(0, 2**66).map(hex))


def _leaves() -> st.SearchStrategy[str]:
    maps = st.sampled_from(["@", "@a", "@b", "@s", "@h"])
    return st.one_of(
        _ints(), st.sampled_from(BUILTINS), st.sampled_from(STRINGS),
        maps, st.builds(lambda m, k: f"{m}[{k}]", maps, st.sampled_from(["1", "pid", "comm",
                                                                         "1, 2", "func", '"k"'])),
        st.sampled_from(["$x", "$y", "$s", "$1", "$2", "$#", "$0", "$99999999999999999999"]),
        st.sampled_from(["count()", "sum(arg0)", "kaddr(\"vfs_read\")", "kstack", "kstack(3)",
                         "kstack(perf, 4)", "kstack(200)", "sizeof(struct task_struct)",
                         "sizeof(uint32)", "offsetof(struct task_struct, pid)", "ntop(arg0)",
                         "str(arg0)", "str(arg1, 8)", "ksym(arg0)", "rand", "buf(arg0, 8)"]),
    )


def _expressions() -> st.SearchStrategy[str]:
    def extend(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
        one = st.sampled_from
        return st.one_of(
            st.builds(lambda a, op, b: f"{a} {op} {b}", inner, one(OPERATORS), inner),
            st.builds(lambda op, a: f"{op}{a}", one(["!", "~", "-", "+", "*", "&", "--"]), inner),
            st.builds(lambda a: f"({a})", inner),
            st.builds(lambda c, a, b: f"{c} ? {a} : {b}", inner, inner, inner),
            st.builds(lambda ty, a: f"({ty}){a}", one(TYPES), inner),
            st.builds(lambda a, arrow, f: f"{a}{arrow}{f}", inner, one(["->", "."]), one(FIELDS)),
            st.builds(lambda a, i: f"{a}[{i}]", inner, inner),
            st.builds(lambda m, a: f"{m}[{a}]", one(["@a", "@b", "@", "@s"]), inner),
            st.builds(lambda a, b: f"({a}, {b})", inner, inner),
            st.builds(lambda f, a: f"{f}({a})", one(["str", "ksym", "ntop", "bswap", "sizeof",
                                                     "hist", "sum", "max", "avg", "count",
                                                     "stats", "nosuch", "usym", "reg", "buf",
                                                     "kstack", "has_key", "print"]), inner),
            st.builds(lambda a, n: f"str({a}, {n})", inner, _ints()),
            st.builds(lambda a, b, n: f"strncmp({a}, {b}, {n})", inner, inner, _ints()),
            st.builds(lambda a: f"has_key(@a, {a})", inner),
            st.builds(lambda f, a: f'strftime("{f}", {a})', one(["%H", "%s", "\\0", ""]), inner),
        )
    return st.recursive(_leaves(), extend, max_leaves=8)


def _printf() -> st.SearchStrategy[str]:
    fmt = st.lists(st.sampled_from(FORMATS), max_size=5).map("".join)
    args = st.lists(_expressions(), max_size=4)
    return st.builds(lambda f, a: "printf(" + ", ".join([f'"{f}"', *a]) + ")", fmt, args)


def _statements() -> st.SearchStrategy[str]:
    e = _expressions()
    one = st.sampled_from
    target = st.one_of(one(["@", "@a", "@b", "@s", "@h", "$x", "$y", "$s", "$1"]),
                       st.builds(lambda m, k: f"{m}[{k}]", one(["@a", "@b", "@h", "@"]), e))
    simple = st.one_of(
        st.builds(lambda t, op, v: f"{t} {op} {v}", target,
                  one(["=", "+=", "-=", "*=", "/=", "%=", "&=", "|=", "^=", "<<=", ">>="]), e),
        st.builds(lambda t, agg: f"{t} = {agg}", target, one([
            "count()", "sum(arg0)", "min(arg1)", "max(retval)", "avg(arg2)", "stats(arg0)",
            "hist(arg0)", "hist(arg0, 2)", "lhist(arg0, 0, 100, 10)", "lhist(arg0, 0, 1000000, 1)",
            "lhist(arg0, 10, 0, 1)", "lhist(arg0, -5, 5, 0)", "count(1)"])),
        st.builds(lambda t, op: f"{t}{op}", target, one(["++", "--"])),
        st.builds(lambda v, ty, x: f"let {v}{ty} = {x}", one(["$x", "$z", "$1", "@a"]),
                  one(["", ": uint32", ": string", ": struct task_struct *", ": int[4]"]), e),
        st.builds(lambda m, k: f"delete({m}[{k}])", one(["@a", "@b", "@"]), e),
        st.builds(lambda m, k: f"delete({m}, {k})", one(["@a", "@b"]), e),
        st.builds(lambda f, m: f"{f}({m})", one(["clear", "zero", "print", "delete"]),
                  one(["@a", "@b", "@", "@h", "1", "$x"])),
        st.builds(lambda x: f"print({x})", e),
        st.builds(lambda m, a, b: f"print({m}, {a}, {b})", one(["@a", "@h"]), _ints(), _ints()),
        _printf(),
        one(["time()", 'time("%H:%M:%S\\n")', 'time("\\0")', "join(arg1)", 'join(arg1, ",")',
             "exit()", "exit(3)", "return", "kstack", "cat(\"/etc/passwd\")", "system(\"ls\")",
             "signal(9)", "for ($i : 0..3) { }", "break", "@a[1] = 1"]),
    )

    def extend(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
        block = st.lists(inner, max_size=3).map(lambda ss: "{ " + "; ".join(ss) + " }")
        return st.one_of(
            st.builds(lambda c, a: f"if ({c}) {a}", e, block),
            st.builds(lambda c, a, b: f"if ({c}) {a} else {b}", e, block, block),
            st.builds(lambda c, a, b: f"if {c} {a} else if ({c}) {b}", e, block, block),
            st.builds(lambda n, a: f"unroll({n}) {a}", one(["1", "3", "0", "101", "arg0", "100"]),
                      block),
            st.builds(lambda c, a: f"while ({c}) {a}", e, block),
            block,
        )
    return st.recursive(simple, extend, max_leaves=6)


def _probes() -> st.SearchStrategy[str]:
    points = st.lists(st.sampled_from(ATTACH), min_size=1, max_size=3).map(", ".join)
    pred = st.one_of(st.just(""), _expressions().map(lambda x: f"/{x}/"))
    body = st.lists(_statements(), max_size=4).map(lambda ss: "{ " + "; ".join(ss) + " }")
    return st.builds(lambda p, f, b: f"{p} {f} {b}", points, pred, body)


def _preamble() -> st.SearchStrategy[str]:
    return st.lists(st.sampled_from([
        "#include <linux/sched.h>\n", "#include <nosuch.h>\n", "#include \"x\"\n", "#include\n",
        "#define N 3\n", "#define S \"str\"\n", "#define E\n", "#define F(x) x\n",
        "#define R R + 1\n", "#define D (N << 60) * N\n", "#ifdef N\n", "#ifndef N\n",
        "#if N > 2 && defined(N)\n", "#if 08\n", "#if 1 << 99999999\n", "#elif 1\n", "#else\n",
        "#endif\n", "#undef N\n", "#pragma once\n", "#error stop\n", "#bogus\n",
        "config = { max_map_keys = 16; max_strlen = 32 }\n", "config = { max_map_keys = 0 }\n",
        "config = { nosuch = 1 }\n", "config = { BPFTRACE_MAX_STRLEN = 99999 }\n",
        "struct ksim_rec { int a; char name[8]; struct task_struct *t; };\n",
        "struct bad { int[3] x; };\n", "let @a = hash(16);\n", "let @b = lruhash(0);\n",
        "// a comment\n", "/* a\n block */\n", "/* unterminated\n", "#!/usr/bin/env bpftrace\n",
    ]), max_size=4).map("".join)


PROGRAMS = st.builds(lambda pre, ps: pre + "\n".join(ps), _preamble(),
                     st.lists(_probes(), min_size=1, max_size=3))
#: every token of the language, for a soup of them
TOKENS = [*ATTACH, *BUILTINS, *TYPES, *FIELDS, *INTS, *OPERATORS, *STRINGS, *PUNCT,
          "{", "}", "(", ")", "[", "]", ";", ",", "/", "?", ":", "=", "->", ".", "@", "$", "#",
          "if", "else", "unroll", "while", "for", "let", "return", "config", "struct", "union",
          "hash", "printf", "count()", "hist", "lhist", "\n", " ", "#define", "#include",
          "#if", "#endif", "//", "/*", "*/", '"', "\\", "'", "`", "\t"]


@st.composite
def _mutated(draw: st.DrawFn) -> str:
    """A program of the grammar with a few random edits (deletions, insertions of tokens
    or characters, duplications)."""
    text = draw(PROGRAMS)
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(text)))
        edit = draw(st.sampled_from(["delete", "token", "char", "duplicate"]))
        if edit == "delete":
            text = text[:at] + text[at + draw(st.integers(1, 8)):]
        elif edit == "token":
            text = text[:at] + draw(st.sampled_from(TOKENS)) + text[at:]
        elif edit == "char":
            text = text[:at] + draw(st.characters(codec="utf-8")) + text[at:]
        else:
            end = draw(st.integers(at, min(len(text), at + 40)))
            text = text[:end] + text[at:end] + text[end:]
    return text


def _parse_and_analyse(text: str) -> None:
    """The invariant: a TraceError (which renders) or a program the analysis accepts."""
    try:
        analyse(parse(text, params=("1", "abc")))
    except TraceError as exc:
        assert str(exc)         # the message with its line and marks renders
    except RecursionError:      # pragma: no cover - the bug this tier is here to catch
        pytest.fail("RecursionError")


@bounded(250)
@given(PROGRAMS)
def test_programs_of_the_grammar_parse_or_fail_with_a_trace_error(text: str) -> None:
    _parse_and_analyse(text)


@bounded(250)
@given(_mutated())
def test_mutated_programs_parse_or_fail_with_a_trace_error(text: str) -> None:
    _parse_and_analyse(text)


@bounded(200)
@given(st.lists(st.sampled_from(TOKENS), max_size=40).map(" ".join))
def test_a_soup_of_tokens_parses_or_fails_with_a_trace_error(text: str) -> None:
    _parse_and_analyse(text)


@bounded(200)
@given(st.one_of(st.text(max_size=200),
                 st.text(alphabet="{}()[];,/?:=@$#!~-+*&|^<>.'\"\\\n 0123456789abxe_kprobe:",
                         max_size=200),
                 st.binary(max_size=200).map(lambda b: b.decode("utf-8", "replace"))))
def test_random_text_parses_or_fails_with_a_trace_error(text: str) -> None:
    _parse_and_analyse(text)


@pytest.mark.parametrize("shape", [
    "(" * 5000 + "1" + ")" * 5000, "+".join(["1"] * 5000), "!" * 5000 + "1", "- " * 5000 + "1",
    "@a[" * 2000 + "1" + "]" * 2000, "(uint8)" * 2000 + "1", "1 ? 1 : " * 2000 + "1",
    "curtask" + "->parent" * 5000, "bswap(" * 2000 + "1" + ")" * 2000,
])
def test_pathological_nesting_is_refused_quickly(shape: str) -> None:
    """The issue's shapes at sizes far past the bound (the tier's grammar stays small)."""
    with pytest.raises(TraceError, match="nested deeper than"):
        analyse(parse(f"kprobe:f {{ @ = {shape}; }}"))
    body = "if (1) { " * 5000 + "@ = 1;" + " }" * 5000
    with pytest.raises(TraceError, match="nested deeper than"):
        analyse(parse(f"kprobe:f {{ {body} }}"))


# --- accepted programs on a toy kernel --------------------------------------------------------
@pytest.fixture(scope="module")
def toy():
    from ksim.kapi import Manager

    m = Manager.attach("unicorn:toy")
    yield m
    m.detach()


def _state(m) -> tuple:
    """What a refused or detached session must leave as it found it."""
    return m.text_snapshot(), dict(m.splices()), dict(m._heap)


def _session(m, text: str) -> None:
    """Attach, run BEGIN, a short workload, END, detach and free, as ``ksim trace``
    does; a KsimError anywhere is a refusal."""
    from ksim.trace.session import Exited, TraceSession

    session = TraceSession(m, parse(text))
    session.attach()
    try:
        session.begin()
        if not session.exited:
            try:
                m.run(iterations=20, seed=1, **({"progress": p} if (p := session.progress())
                                                else {}))
            except Exited:
                pass
        session.end()
        session.output()
    finally:
        session.detach()
        session.free()


def _kernel_programs() -> st.SearchStrategy[str]:
    """Programs the toy mostly accepts: integer expressions over what a kernel probe
    has (its arguments at an entry, its return value at a return), maps of every
    kind, printf with matching arguments, control flow."""
    one = st.sampled_from

    def expressions(values: list[str]) -> st.SearchStrategy[str]:
        leaf = st.one_of(st.integers(-300, 300).map(str),
                         one([*values, "pid", "tid", "cpu", "nsecs", "@c", "@i[1]", "$x",
                              "0x7fffffffffffffff"]))

        def extend(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
            return st.one_of(
                st.builds(lambda a, op, b: f"({a} {op} {b})", inner, one(OPERATORS), inner),
                st.builds(lambda op, a: f"{op}({a})", one(["!", "~", "-"]), inner),
                st.builds(lambda c, a, b: f"({c} ? {a} : {b})", inner, inner, inner),
                st.builds(lambda ty, a: f"({ty})({a})", one(["uint8", "int16", "uint32", "int64"]),
                          inner),
                st.builds(lambda a: f"@i[{a}]", inner),
                st.builds(lambda a: f"bswap({a})", inner),
            )
        return st.recursive(leaf, extend, max_leaves=6)

    def body(e: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
        simple = st.one_of(
            st.builds(lambda k, v: f"@i[{k}] = {v}", e, e),
            st.builds(lambda v: f"$x = {v}", e),
            st.builds(lambda k, v, agg: f"@a[{k}] = {agg}({v})", e, e,
                      one(["sum", "min", "max", "avg"])),
            st.builds(lambda k: f"@n[{k}] = count()", e),
            st.builds(lambda v: f"@h = hist({v})", e),
            st.builds(lambda v: f"@l = lhist({v}, 0, 200, 20)", e),
            st.builds(lambda v: f"@c += {v}", e),
            st.just("@c++"), st.just("@s[comm] = count()"), st.just("@t[func, probe] = count()"),
            st.builds(lambda k: f"delete(@i[{k}])", e),
            st.builds(lambda f, a: f'printf("{f}\\n", {a})', one(["%d", "%x", "%-5u", "%08o"]),
                      e),
            st.builds(lambda a, b: f'printf("%s %d %c\\n", comm, {a}, {b})', e, e),
            st.just("time()"),
            st.builds(lambda a: f"if ({a} > 250) {{ exit(); }}", e),
        )
        block = st.lists(simple, min_size=1, max_size=3).map("; ".join)
        stmts = st.one_of(block, st.builds(lambda c, a, b: f"if ({c}) {{ {a} }} else {{ {b} }}",
                                           e, block, block),
                          st.builds(lambda n, a: f"unroll({n}) {{ {a} }}", st.integers(1, 3),
                                    block))
        return stmts.map(lambda b: "$x = 0; " + b)

    def probes(points: list[str], values: list[str]) -> st.SearchStrategy[str]:
        e = expressions(values)
        return st.builds(lambda p, f, b: f"{p} {f}{{ {b} }}", one(points),
                         st.one_of(st.just(""), e.map(lambda x: f"/{x}/ ")), body(e))

    probe = st.one_of(
        probes(["kprobe:vfs_read", "kprobe:vfs_write", "kprobe:vfs_*", "kprobe:tcp_sync_mss",
                "kprobe:vfs_read+0"], ["arg0", "arg1", "arg2"]),
        probes(["kretprobe:vfs_read", "kretprobe:vfs_llseek"], ["retval"]))
    begin_end = one(["", "END { print(@c); clear(@i) } ", 'BEGIN { printf("%d\\n", @c + 1) } ',
                     "config = { max_map_keys = 8 } "])
    return st.builds(lambda pre, ps: pre + "BEGIN { @c = 1; @i[2] = 3 } " + " ".join(ps),
                     begin_end, st.lists(probe, min_size=1, max_size=2))


@bounded(40)
@given(st.one_of(_kernel_programs(), _kernel_programs(), PROGRAMS))
def test_programs_attach_run_and_detach_leaving_nothing(toy, text: str) -> None:
    before = _state(toy)
    try:
        _session(toy, text)
        event("ran")
    except KsimError as exc:
        event(f"refused: {type(exc).__name__}")
        assert str(exc)
    except RecursionError:      # pragma: no cover
        pytest.fail("RecursionError")
    assert _state(toy) == before


@pytest.mark.parametrize("text", [
    # refused when compiled, after the maps and the ring were allocated
    "kprobe:vfs_read { @ = 1; printf(\"%d\\n\", 1); } kprobe:vfs_write { "
    + "; ".join(f"$v{i} = str(arg0)" for i in range(20)) + "; }",
    # refused by the point: no offset 1 inside vfs_write's first instruction
    "kprobe:vfs_read { @ = count(); } kprobe:vfs_write+1 { @b = count(); }",
    "kprobe:vfs_read { @[" + "@a[" * 60 + "arg0" + "]" * 60 + "] = count(); @a[1] = 1; }",
])
def test_a_refused_attach_leaves_nothing(toy, text: str) -> None:
    before = _state(toy)
    try:
        _session(toy, text)
    except KsimError:
        pass
    assert _state(toy) == before


# --- the snippets' check ----------------------------------------------------------------------
def test_deep_and_shared_snippets_are_refused_without_recursion() -> None:
    from ksim.snippets import ast
    from ksim.snippets.check import MAX_DEPTH, MAX_NODES, SnippetTooLarge, check

    v = ast.Var(0x1000)
    deep = v
    for _ in range(20 * MAX_DEPTH):
        deep = -deep
    with pytest.raises(SnippetTooLarge, match=f"deeper than {MAX_DEPTH}"):
        check(v.assign(deep))
    shared = v                  # 2**200 paths through 200 distinct nodes
    for _ in range(200):
        shared = shared + shared
    with pytest.raises(SnippetTooLarge, match=f"more than {MAX_NODES} nodes"):
        check(v.assign(shared))
    ok = v
    for _ in range(MAX_DEPTH - 4):
        ok = ok + 1
    check(v.assign(ok))


@bounded(150)
@given(st.recursive(
    st.one_of(st.integers(-2**70, 2**70), st.sampled_from(["x", None, 1.5, b"", ()])),
    lambda inner: st.builds(lambda kind, *xs: (kind, *xs), st.sampled_from(
        ["add", "div", "neg", "if", "seq", "assign", "load", "land", "elem", "call"]),
        inner, inner, inner), max_leaves=12))
def test_random_snippets_are_checked_or_refused(tree) -> None:
    from ksim.snippets import ast
    from ksim.snippets.check import check

    v = ast.Var(0x1000)

    def build(x):
        if not isinstance(x, tuple) or not x:
            return x
        kind, a, b, c = x[0], build(x[1]), build(x[2]), build(x[3])
        return {"add": lambda: ast.BinOp("add", a, b), "div": lambda: ast.BinOp("div", a, b),
                "neg": lambda: ast.Unary("neg", a), "if": lambda: ast.If(a, b, c),
                "seq": lambda: ast.Seq((a, b, c)), "assign": lambda: ast.Assign(v, a),
                "load": lambda: ast.Load(a, 8), "land": lambda: ast.LogicalAnd(a, b),
                "elem": lambda: ast.Elem(0x2000, 4, a), "call": lambda: ast.Call(0x3000, (a, b)),
                }[kind]()

    snippet = build(tree)
    try:
        check(snippet)
    except SnippetError as exc:
        assert str(exc)


# --- kerninstd's wire protocol ----------------------------------------------------------------
JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
              st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20),
              st.sampled_from(["\0", "\udc80", "ab" * 32, "zz", "90", "cc", "r", "mkdir"])),
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12)


def _value(arg: wire.Arg) -> st.SearchStrategy:
    """A value of ``arg``'s kind, near and past its bounds, or of another JSON type."""
    lo, hi = arg.lo, arg.hi
    if arg.kind == "int":
        good = st.one_of(st.integers(int(lo), int(hi)),
                         st.sampled_from([int(lo), int(hi), int(lo) - 1, int(hi) + 1]))
    elif arg.kind == "number":
        good = st.one_of(st.floats(lo, hi), st.sampled_from([lo, hi, -1.0, math.inf, math.nan]),
                         st.integers(-2**64, 2**64))
    elif arg.kind == "bool":
        good = st.booleans()
    elif arg.kind == "str":
        good = st.one_of(st.text(max_size=min(int(hi), 40)), st.sampled_from(["", "a\0b", "\udc80"]))
    elif arg.kind == "hex":
        good = st.one_of(st.binary(min_size=int(lo), max_size=min(int(hi), 40)).map(bytes.hex),
                         st.sampled_from(["", "0", "zz", "a b"]))
    else:
        item = st.tuples(*(_value(f) for _, f in arg.fields)).map(list)
        good = st.lists(st.one_of(item, JSON), max_size=4)
    return st.one_of(good, JSON)


@st.composite
def _requests(draw: st.DrawFn) -> dict:
    """A request of one of the ops, its fields drawn from what each argument allows (and
    from outside it), some left out, some extra."""
    op = wire.OPS[draw(st.sampled_from(sorted(wire.OPS)))]
    message: dict = {"v": draw(st.sampled_from([1, 1, 1, 2, True, "1"])),
                     "id": draw(st.one_of(st.integers(0, 2**64), JSON)), "op": op.name}
    for name, arg in op.args.items():
        if draw(st.integers(0, 9)):
            message[name] = draw(_value(arg))
    if draw(st.booleans()):
        message.update(draw(st.dictionaries(st.text(max_size=6), JSON, max_size=2)))
    return message


def _known_number_overflow(message: dict) -> bool:
    """check_value's number kind converts an int past a float's range (exec's
    timeout of 10**400) to a float: OverflowError, not ProtocolError (see
    test_a_huge_integer_number_is_a_protocol_error)."""
    op = wire.OPS.get(message.get("op"))  # type: ignore[arg-type]
    return op is not None and any(
        arg.kind == "number" and isinstance(message.get(name), int)
        and abs(message[name]) > 1e308 for name, arg in op.args.items())


def _check_request(message: dict) -> None:
    try:
        op, args = wire.check_request(message)
    except ProtocolError:
        return
    except OverflowError:
        assert _known_number_overflow(message)
        return
    # success: every argument of the op is there, typed and within its bounds
    assert set(args) == set(op.args)
    for name, arg in op.args.items():
        _conforms(args[name], arg)


def _conforms(value, arg: wire.Arg) -> None:
    if arg.kind == "int":
        assert type(value) is int and arg.lo <= value <= arg.hi
    elif arg.kind == "number":
        assert type(value) is float and math.isfinite(value) and arg.lo <= value <= arg.hi
    elif arg.kind == "bool":
        assert type(value) is bool
    elif arg.kind == "str":
        assert type(value) is str and "\0" not in value
        assert arg.lo <= len(value.encode()) <= arg.hi
    elif arg.kind == "hex":
        assert type(value) is bytes and arg.lo <= len(value) <= arg.hi
    else:
        assert type(value) is list and arg.lo <= len(value) <= arg.hi
        for item in value if arg.fields else ():
            assert type(item) is tuple and len(item) == len(arg.fields)
            for x, (_, field) in zip(item, arg.fields, strict=True):
                _conforms(x, field)


def _pipeline(frame: bytes, limit: int = wire.MAX_FRAME) -> None:
    """A frame as kerninstd reads it: header, body, JSON, request."""
    if len(frame) < wire.HEADER.size:
        return
    try:
        n = wire.frame_length(frame[:wire.HEADER.size], limit)
    except ProtocolError:
        return
    assert 0 < n <= limit
    body = frame[wire.HEADER.size:wire.HEADER.size + n]
    try:
        message = wire.decode(body)
    except ProtocolError:
        return
    assert isinstance(message, dict)
    _check_request(message)


@bounded(300)
@given(_requests())
def test_request_fields_are_checked_or_refused(message: dict) -> None:
    _check_request(message)


@bounded(200)
@given(st.one_of(st.binary(max_size=300),
                 st.builds(lambda b: struct.pack(">I", len(b)) + b, st.binary(max_size=300)),
                 st.builds(lambda v: wire.HEADER.pack(len(s := json.dumps(v).encode())) + s,
                           JSON)),
       st.sampled_from([wire.MAX_FRAME, wire.MAX_AUTH_FRAME]))
def test_random_frames_are_decoded_or_refused(frame: bytes, limit: int) -> None:
    _pipeline(frame, limit)


@st.composite
def _mutated_frames(draw: st.DrawFn) -> bytes:
    message = draw(_requests())
    try:
        frame = bytearray(wire.encode(message))
    except (ProtocolError, ValueError, TypeError):
        frame = bytearray(wire.encode({"v": 1, "id": 1, "op": "hello"}))
    for _ in range(draw(st.integers(1, 6))):
        at = draw(st.integers(0, len(frame)))
        edit = draw(st.sampled_from(["flip", "insert", "delete", "truncate", "length"]))
        if edit == "flip" and at < len(frame):
            frame[at] ^= 1 << draw(st.integers(0, 7))
        elif edit == "insert":
            frame[at:at] = draw(st.binary(min_size=1, max_size=4))
        elif edit == "delete":
            del frame[at:at + draw(st.integers(1, 4))]
        elif edit == "truncate":
            del frame[at:]
        elif edit == "length" and len(frame) >= 4:
            frame[:4] = struct.pack(">I", len(frame) - 4)   # the body's own length again
    return bytes(frame)


@bounded(300)
@given(_mutated_frames())
def test_mutated_frames_are_decoded_or_refused(frame: bytes) -> None:
    _pipeline(frame)


def test_a_huge_integer_number_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError):
        wire.check_request({"v": 1, "id": 1, "op": "exec", "cmd": "true", "timeout": 10**400})


@pytest.mark.parametrize("error", [[1], "text"])
def test_a_reply_whose_error_is_not_an_object_is_a_ksim_error(error) -> None:
    with pytest.raises(KsimError):
        wire.raise_for({"v": 1, "id": 1, "ok": False, "error": error})
