"""The trace language's parser and static checks: the tree it builds, errors that
name line and columns the way bpftrace's language reports them, and constructs
outside the subset refused by name."""

from __future__ import annotations

import json

import pytest

from ksim.trace import syntax as t
from ksim.trace.compiler import analyse
from ksim.trace.errors import TraceError, TraceSemanticError, TraceSyntaxError, TraceUnsupported
from ksim.trace.parser import parse


def error_of(source: str, filename: str = "stdin") -> TraceError:
    with pytest.raises(TraceError) as info:
        analyse(parse(source, filename))
    return info.value.located(source, filename) if info.value.source is None else info.value


def test_probes_filters_and_statements():
    p = parse("kprobe:vfs_*, k:f+0x10, kr:g /pid == 1 && arg0 > 2/ {\n"
              "  @[func] = count(); $x = 1 + 2 * 3;\n"
              "  if ($x > 6) { @a++ } else if ($x) { @b[pid, tid] += 2; } else { delete(@b[1, 2]) }\n"
              "}\nBEGIN { @a = 0 } END { print(@a); clear(@b); exit() }")
    first = p.probes[0]
    assert [(a.provider, a.func, a.offset) for a in first.points] == [
        ("kprobe", "vfs_*", None), ("kprobe", "f", 16), ("kretprobe", "g", None)]
    assert first.points[0].wildcard and not first.points[1].wildcard
    assert isinstance(first.pred, t.Binary) and first.pred.op == "&&"
    count, scratch, cond = first.body
    assert isinstance(count, t.Assign) and count.target == t.MapRef(count.target.loc, "@", (
        t.Builtin(count.target.keys[0].loc, "func"),))
    # C precedence: 1 + (2 * 3)
    assert isinstance(scratch, t.Assign) and scratch.value.op == "+" and scratch.value.right.op == "*"
    assert isinstance(cond, t.If) and isinstance(cond.orelse[0], t.If)
    assert cond.then[0] == t.Assign(cond.then[0].loc, t.MapRef(cond.then[0].target.loc, "@a"), "+=",
                                    t.Int(cond.then[0].value.loc, 1))
    assert [ap.provider for pr in p.probes[1:] for ap in pr.points] == ["BEGIN", "END"]


@pytest.mark.parametrize("expr,shape", [
    ("1 | 2 ^ 3 & 4", ("|", 1, ("^", 2, ("&", 3, 4)))),
    ("1 == 2 < 3", ("==", 1, ("<", 2, 3))),
    ("1 << 2 + 3", ("<<", 1, ("+", 2, 3))),
    ("1 - 2 - 3", ("-", ("-", 1, 2), 3)),
    ("1 || 2 && 3", ("||", 1, ("&&", 2, 3))),
    ("-1 * !2", ("*", ("-", 1), ("!", 2))),
    ("1 ? 2 : 3 ? 4 : 5", ("?", 1, 2, ("?", 3, 4, 5))),
    ("0x10 + 1_000", ("+", 16, 1000)),
])
def test_operator_precedence_is_c(expr, shape):
    def tree(e):
        if isinstance(e, t.Int):
            return e.value
        if isinstance(e, t.Binary):
            return (e.op, tree(e.left), tree(e.right))
        if isinstance(e, t.Unary):
            return (e.op, tree(e.operand))
        assert isinstance(e, t.Ternary)
        return ("?", tree(e.cond), tree(e.then), tree(e.orelse))

    stmt = parse(f"BEGIN {{ $x = {expr}; }}").probes[0].body[0]
    assert tree(stmt.value) == shape


def test_a_filter_may_divide():
    pred = parse("kprobe:f /arg0 / 2 > 1/ { @ = count() }").probes[0].pred
    assert pred.op == ">" and pred.left.op == "/"


def test_comments_and_files_name_the_file():
    source = "// counts\n/* block\n comment */ kprobe:f {\n  @ = count();\n  @x = );\n}\n"
    err = error_of(source, "prog.bt")
    assert str(err).splitlines() == [
        "prog.bt:5:8-9: ERROR: syntax error, unexpected ')', expecting an expression",
        "  @x = );",
        "       ~",
    ]


@pytest.mark.parametrize("source,head", [
    ("kprobe:f { @ = ); }", "stdin:1:16-17: ERROR: syntax error, unexpected ')'"),
    ("kprobe:f { @x = 1 @y = 2 }", "stdin:1:19-21: ERROR: syntax error, unexpected '@y', expecting ';' or '}'"),
    ("kprobe:f { @x = 1;", "stdin:1:19-20: ERROR: syntax error, unexpected end of file, expecting '}'"),
    ("kprobe:f /pid { }", "stdin:1:15-16: ERROR: syntax error, unexpected '{', expecting '/'"),
    ("kprobes:f {}", "stdin:1:1-10: ERROR: Invalid probe type: kprobes"),
    ("kprobe:f { @x = \"abc }", "stdin:1:17-23: ERROR: unterminated string"),
    ("kprobe:f { @x = 1 $ }", "stdin:1:19-21: ERROR: expected a variable name after '$'"),
    ("kprobe:f { @x = 12ab; }", "stdin:1:17-20: ERROR: invalid integer literal '12a'"),
    ("kretprobe:f+1 {}", "stdin:1:1-14: ERROR: Offset not allowed for kretprobe"),
    ("kprobe:f* +1 {}", "stdin:1:11-12: ERROR: syntax error, unexpected '+', expecting '{'"),
])
def test_syntax_errors_name_line_and_columns(source, head):
    err = error_of(source)
    assert isinstance(err, TraceSyntaxError | TraceSemanticError)
    assert str(err).startswith(head), str(err)
    line, marks = str(err).splitlines()[1:]
    assert line == source.splitlines()[0]
    col, end = err.loc.col, err.loc.end
    assert marks == " " * (col - 1) + "~" * (end - col)


@pytest.mark.parametrize("source,construct", [
    ("uprobe:/bin/sh:main { }", "uprobe probes are not supported: they instrument user space"),
    ("uretprobe:/bin/sh:main { }", "uretprobe probes"),
    ("usdt:/bin/sh:probe { }", "usdt probes"),
    ("software:faults:1 { }", "software probes"),
    ("kprobe:mod:f { }", "kprobe with a module"),
    ("kprobe:f { for ($k, $v : @m) { } }", "for loops over a map's entries bind one variable"),
    ("kprobe:f { @x = cpid; }", "cpid is not supported"),
    ('kprobe:f { @x = strcontains(comm, comm); }', "strcontains() with a needle that is not a "
     "string literal"),
    ("#define M(x) x\nkprobe:f { }", "function-like macros"),
    ("kprobe:f { @x = &arg0; }", "taking an address"),
    ("kprobe:f { @[usym(arg0)] = count(); }", "function usym()"),
    ("kprobe:f { printf(\"%f\\n\", 1); }", "printf conversion '%f\\n'"),
    ("kprobe:f { @x = hist(arg0, 2); }", "hist() with a precision argument"),
    ("kprobe:f { @x = path(arg0); }", "function path()"),
])
def test_constructs_outside_the_subset_are_refused_by_name(source, construct):
    err = error_of(source)
    assert isinstance(err, TraceUnsupported), str(err)
    assert construct in str(err) and "not supported" in str(err)
    assert str(err).startswith("stdin:") and err.loc is not None


@pytest.mark.parametrize("source,message", [
    ("kprobe:f { @x = count(); @x = sum(arg0); }",
     "Type mismatch for @x: trying to assign value of type 'sum' when map already contains a "
     "value of type 'count'"),
    ("kprobe:f { @x[pid] = count(); @x[func] = count(); }",
     "Argument mismatch for @x: trying to access with arguments: [ksym] when map expects "
     "arguments: [int]"),
    ("kprobe:f { @x = foo; }", "Unknown identifier: 'foo'"),
    ("kprobe:f { @x = foo(1); }", "Unknown function: foo"),
    ("kprobe:f { @x = 1 + count(); }", "count() should be directly assigned to a map"),
    ("kprobe:f { @x = lhist(arg0, 0, 10); }", "lhist() expects 4 arguments (3 provided)"),
    ("kprobe:f { @x = lhist(arg0, 10, 0, 1); }", "lhist() needs max > min and step > 0"),
    ("kprobe:f { @x = lhist(arg0, 0, 10, $s); }", "integer literals"),
    ("kprobe:f { @x = @y; }", "Undefined map: @y"),
    ("kprobe:f { print(@x[1]); @x[1] = 1 }", "print() expects a map with no keys"),
    ("kprobe:f { clear(1); }", "clear() expects a map argument"),
    ("kprobe:f { printf(\"%d %d\\n\", 1); }", "printf: Not enough arguments for format string"),
    ("kprobe:f { printf(\"%d\\n\", 1, 2); }", "printf: Too many arguments for format string"),
    ("kprobe:f { printf(\"%d\\n\", func); }", "printf: %d specifier expects a value of type integer"),
    ("kprobe:f { printf(arg0); }", "printf() expects a format string first"),
    ("kprobe:f { @x = 1 / 0; }", "Divide or modulo by 0"),
    ("kprobe:f { @x = comm + 1; }", "a value of type comm is not an integer here"),
    ("kprobe:f { printf(\"%s\\n\", arg0); }", "%s specifier expects a value of type string"),
    ("kprobe:f { @x = \"a\"; @x = 1; }", "Type mismatch for @x"),
    ("kprobe:f { @x = (struct nosuch *)arg0; }", "Unknown struct/union: 'struct nosuch'"),
    ("kprobe:f { @x = arg0->next; }", "cannot access field 'next' of a value of type uint64"),
    ("kprobe:f { $s = 1; @x = $s.a; }", "cannot access field 'a'"),
    ("kprobe:f { @x = *(uint8)arg1; }", "cannot dereference a value of type uint8"),
    ("struct S { int a; }; kprobe:f { @x = ((struct S *)arg0)->b; }",
     "struct S has no field named b (it has: a)"),
    ("kprobe:f { @x[1] = 1; @y = @x[comm]; }", "Argument mismatch for @x"),
])
def test_meaningless_programs_are_refused(source, message):
    try:
        analyse(parse(source))
    except TraceSemanticError as exc:
        assert message is not None and message in str(exc), str(exc)
    else:
        assert message is None      # refused later, when compiled for a point


def test_a_cast_is_parsed_whole_and_never_taken_for_a_struct_definition():
    program = parse("kprobe:vfs_open { $p = (struct path *) arg0; @x = (uint8)arg1; }")
    cast = program.probes[0].body[0].value
    assert isinstance(cast, t.Cast) and cast.type == "struct path *"
    assert isinstance(cast.operand, t.Builtin) and cast.operand.name == "arg0"
    inner = parse("kprobe:f { @x = (arg0) + (int8x); }")   # parentheses, not casts
    assert not isinstance(inner.probes[0].body[0].value, t.Cast)


def test_a_config_block_sets_max_map_keys():
    for text in ("config = { max_map_keys = 10000 }", "config={BPFTRACE_MAX_MAP_KEYS=10000;}",
                 "config = {\n  max_map_keys = 10_000;\n}"):
        program = parse(text + "\nkprobe:f { @[arg0] = count(); }")
        assert program.config == {"max_map_keys": 10000} and len(program.probes) == 1
    assert parse("kprobe:f { }").config == {}
    err = error_of("config = { max_map_keys = 1 } kprobe:f { } config = { max_map_keys = 2 }")
    assert isinstance(err, TraceSyntaxError) and "must come first" in str(err)


def test_errors_have_their_own_wire_codes():
    from ksim.errors import all_error_classes

    codes = all_error_classes()
    for cls in (TraceError, TraceSyntaxError, TraceUnsupported, TraceSemanticError):
        assert codes[cls.code] is cls


# --- bounds: every size a program controls ---------------------------------------------------
def _nested(shape: str, n: int) -> str:
    body = {
        "parentheses": "(" * n + "1" + ")" * n,
        "sum": "+".join(["1"] * n),
        "not": "!" * n + "1",
        "minus": "- " * n + "1",
        "ternary": "arg0 ? 1 : " * n + "2",
        "map keys": "@a[" * n + "1" + "]" * n,
        "casts": "(uint8)" * n + "arg0",
        "calls": "bswap(" * n + "arg0" + ")" * n,
        "fields": "curtask" + "->parent" * n,
    }.get(shape)
    if body is not None:
        return f"kprobe:f {{ @ = {body}; @a[1] = 1; }}"
    return {"ifs": "kprobe:f { " + "if (arg0) { " * n + "@ = 1;" + " }" * n + " }",
            "else ifs": "kprobe:f { if (arg0) { @ = 0; }" + " else if (arg1) { @ = 1; }" * n + " }",
            "blocks": "kprobe:f { " + "{ " * n + "@ = 1;" + " }" * n + " }"}[shape]


@pytest.mark.parametrize("shape,n", [
    ("parentheses", 70), ("sum", 500), ("ifs", 400), ("not", 3000), ("minus", 3000),
    ("ternary", 300), ("map keys", 100), ("casts", 100), ("calls", 100), ("fields", 300),
    ("else ifs", 300), ("blocks", 200), ("parentheses", 100_000), ("sum", 100_000),
])
def test_nesting_deeper_than_the_bound_is_a_specific_error(shape, n):
    from ksim.trace.parser import MAX_DEPTH, TraceLimit

    err = error_of(_nested(shape, n))
    assert isinstance(err, TraceLimit) and err.code == "trace-limit"
    assert f"nested deeper than {MAX_DEPTH} levels" in err.message and err.loc is not None


@pytest.mark.parametrize("shape", ["parentheses", "sum", "not", "ternary", "map keys", "casts",
                                   "calls", "ifs", "else ifs", "blocks"])
def test_nesting_within_the_bound_is_analysed(shape):
    from ksim.trace.parser import MAX_DEPTH

    analyse(parse(_nested(shape, MAX_DEPTH - 4)))


@pytest.mark.parametrize("text,value", [
    ("007", 7), ("010", 8), ("0", 0), ("00", 0), ("0x1F", 31), ("0X1f", 31), ("1_000", 1000),
    ("1e6", 10**6), ("2E3", 2000), ("18446744073709551615", (1 << 64) - 1),
    ("0xffffffffffffffff", (1 << 64) - 1), ("1e19", 10**19),
])
def test_integer_literals_as_bpftrace_reads_them(text, value):
    assert parse(f"BEGIN {{ @ = {text}; }}").probes[0].body[0].value.value == value


@pytest.mark.parametrize("text,words", [
    ("08", "invalid octal literal '08'"), ("0779", "invalid octal literal"),
    ("18446744073709551616", "is too large (the largest is 18446744073709551615)"),
    ("9" * 5000, "is too large"), ("1e99999999", "is too large"), ("2e19", "is too large"),
    ("0x1" + "0" * 16, "is too large"), ("0x_", "invalid integer literal"),
    ("12ab", "invalid integer literal"),
])
def test_bad_integer_literals_are_syntax_errors(text, words):
    err = error_of(f"BEGIN {{ @ = {text}; }}")
    assert isinstance(err, TraceSyntaxError) and words in err.message
    assert len(err.message) < 200 and (err.loc.line, err.loc.col) == (1, 13)


@pytest.mark.parametrize("text,words", [
    ("-9223372036854775809", "'-9223372036854775809' is too small (the smallest is "
     "-9223372036854775808)"),
    ("-0x8000000000000001", "'-9223372036854775809' is too small"),
    ("-18446744073709551615", "is too small"), ("-1e19", "is too small"),
])
def test_negated_literals_below_64_bits_are_syntax_errors(text, words):
    """-18446744073709551615 was masked to 1, where 18446744073709551616 is refused."""
    err = error_of(f"BEGIN {{ @ = 1 + {text}; }}")
    assert isinstance(err, TraceSyntaxError) and words in err.message
    assert (err.loc.line, err.loc.col, err.loc.end) == (1, 17, 17 + len(text))
    smallest = parse("BEGIN { @ = -9223372036854775808; }").probes[0].body[0].value
    assert isinstance(smallest, t.Unary) and smallest.operand.value == 1 << 63


@pytest.mark.parametrize("param,words", [
    ("-99999999999999999999999999", "is too small (the smallest is -9223372036854775808)"),
    ("-9223372036854775809", "is too small"), ("-" + "9" * 5000, "is too small"),
    ("18446744073709551616", "is too large (the largest is 18446744073709551615)"),
    ("0x10000000000000000", "is too large"), ("9" * 5000, "is too large"),
])
def test_parameters_outside_64_bits_are_syntax_errors(param, words):
    """$1 below -2**63 was masked to a positive number, one above 2**64 - 1 to any."""
    source = "kprobe:f { if ($1 > 0) { @ = count(); } }"
    with pytest.raises(TraceSyntaxError) as info:
        parse(source, params=(param,))
    err = info.value.located(source, "stdin")
    assert f"parameter $1 ('{param[:20]}" in err.message and words in err.message
    assert len(err.message) < 200 and (err.loc.line, err.loc.col) == (1, 16)
    with pytest.raises(TraceSyntaxError, match=f"option --n={param[:20]}.* {words[:12]}"):
        parse('BEGIN { @ = getopt("n", 1); }', params=(f"--n={param}",))


@pytest.mark.parametrize("param,value", [
    ("-9223372036854775808", 1 << 63), ("-1", (1 << 64) - 1), ("18446744073709551615",
                                                               (1 << 64) - 1), ("0x10", 16),
])
def test_parameters_within_64_bits_are_their_twos_complement(param, value):
    p = parse('BEGIN { @ = $1 + getopt("n", 1); }', params=(param, f"--n={param}"))
    assert p.probes[0].body[0].value.left.value == value
    assert p.probes[0].body[0].value.right.value == value
    assert isinstance(parse("BEGIN { @ = $1; }", params=("9" * 20 + "x",)).probes[0].body[0].value,
                      t.Str)


def test_positional_parameters_past_any_given_are_missing():
    p = parse("BEGIN { @ = $" + "9" * 5000 + " + $1; }", params=("5",))
    assert p.probes[0].body[0].value.left.value == 0 and p.probes[0].body[0].value.right.value == 5


def test_unroll_and_macros_are_bounded():
    from ksim.trace.parser import MAX_EXPANDED, MAX_UNROLLED, TraceLimit

    body = "@ = 1; " * 10
    assert len(parse(f"kprobe:f {{ unroll(100) {{ {body} }} }}").probes[0].body) == 1000
    err = error_of("kprobe:f { unroll(100) { unroll(100) { unroll(100) { @ = 1; } } } }")
    assert isinstance(err, TraceLimit) and f"more than {MAX_UNROLLED} statements" in err.message
    # a macro of macros doubles at each level
    chain = "".join(f"#define M{i} M{i - 1} + M{i - 1}\n" for i in range(1, 40))
    err = error_of("#define M0 1\n" + chain + "BEGIN { @ = M39; }")
    assert isinstance(err, TraceLimit)
    err = error_of("#define W " + "x" * 600_000 + "\nBEGIN { @ = W + W; }")
    assert isinstance(err, TraceLimit) and f"more than {MAX_EXPANDED} characters" in err.message
    assert err.loc.line == 2


def test_printf_fields_wider_than_the_bound_are_refused():
    from ksim.trace.events import MAX_FIELD, render
    from ksim.trace.parser import TraceLimit

    for fmt in ("%999999999d", "%.99999999999999999999999999s", f"%-{MAX_FIELD + 1}x",
                "%0" + "9" * 5000 + "u"):
        err = error_of(f'kprobe:f {{ printf("{fmt}\\n", arg0); }}')
        assert isinstance(err, TraceLimit) and f"wider than {MAX_FIELD}" in err.message
        assert err.loc.col == 19
        with pytest.raises(TraceLimit):
            render(fmt, [1], [])
    analyse(parse(f'kprobe:f {{ printf("%{MAX_FIELD}d %.{MAX_FIELD}s\\n", arg0, comm); }}'))
    assert render(f"%{MAX_FIELD}d", [1], []) == " " * (MAX_FIELD - 1) + "1"


def test_time_formats_with_a_nul_are_refused():
    assert "NUL" in error_of('BEGIN { time("a\\0b"); }').message
    assert "NUL" in error_of('kprobe:f { @ = strftime("\\0", nsecs); }').message


def test_preprocessor_constants_are_64_bit_and_bounded():
    from ksim.trace.preprocess import constant, preprocess

    _, macros = preprocess("#define A (1 << 3)\n#define B A + A\n")
    assert [constant(e, macros) for e in ("B * 2", "-7 / 2", "-7 % 2", "1 ? 2 : 3", "0777",
                                          "0xFFFFFFFFFFFFFFFF", "!0 && 2 > 1")] == \
        [32, -3, -1, 2, 511, -1, 1]
    for e in ("08", "9" * 5000, "1 << 9999999999", "1 / 0", "(" * 100 + "1" + ")" * 100, "(1"):
        assert constant(e, macros) is None
        err = error_of(f"#if {e}\n#endif\nBEGIN {{ }}")
        assert isinstance(err, TraceSyntaxError) and "#if: cannot evaluate" in err.message
    # one pass over the program, however many directives (it was quadratic)
    import time

    start = time.perf_counter()
    preprocess("#define X 1\n" * 50_000)
    assert time.perf_counter() - start < 5


def _run_trace(argv, capsys):
    from ksim.cli import main

    status = main(["trace", *argv])
    return status, capsys.readouterr()


def test_a_program_file_that_is_not_utf8_is_a_specific_error(tmp_path, capsys):
    prog = tmp_path / "bad.bt"
    prog.write_bytes(b"kprobe:vfs_read { @ = count(); }\n// \xff\xfe\n")
    status, out = _run_trace([str(prog)], capsys)
    assert status == 2 and f"{prog}: ERROR: not UTF-8 text (byte 36, line 2" in out.err
    assert "Traceback" not in out.err
    status, out = _run_trace([str(prog), "--json"], capsys)
    assert status == 2 and json.loads(out.out)["error"] == "trace"
    # a command line's bytes that are not UTF-8 come as lone surrogates
    status, out = _run_trace(["-e", "BEGIN { } // \udcff"], capsys)
    assert status == 2 and "the program is not UTF-8 text" in out.err
    status, out = _run_trace(["-e", "BEGIN { }", "\udcff"], capsys)
    assert status == 2 and "parameter $1 is not UTF-8 text" in out.err


def test_a_recursion_error_is_a_specific_error(monkeypatch, capsys):
    """The last resort: whatever the parser's bounds miss ends in a TraceLimit, not a
    traceback."""
    import ksim.commands.trace as command

    def deep(*args, **kwargs):
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(command, "trace", deep)
    status, out = _run_trace(["-e", "BEGIN { }"], capsys)
    assert status == 2 and "the program is nested too deeply to compile" in out.err
    status, out = _run_trace(["-e", "BEGIN { }", "--json"], capsys)
    assert status == 2 and json.loads(out.out)["error"] == "trace-limit"


@pytest.mark.parametrize("source,words", [
    ("BEGIN { @ = ²; }", "invalid character '²'"),          # "²".isdigit(): no int("²")
    ("BEGIN { @ = $0; }", "$0 is not a positional parameter"),
    ("interval:s:" + "9" * 5000 + " { }", "invalid interval probe"),
    ("interval:s:² { }", "invalid interval probe"),
])
def test_what_the_fuzz_tier_found_is_a_trace_error(source, words):
    assert words in error_of(source).message


def test_max_probes_bounds_the_points_a_program_attaches_at(capsys, toy_path):
    status, out = _run_trace(["-e", "config = { max_probes = 5 } kprobe:vfs_* { @[func] = count(); }"],
                             capsys)
    assert status == 2 and "attach at more than 5 points" in out.err
    status, out = _run_trace(["-e", "config = { max_probes = 50 } kprobe:vfs_* { @[func] = count(); }"],
                             capsys)
    assert status == 0 and "@[vfs_read]" in out.out
