"""The C preprocessor lines of a bpftrace program: ``#include``, ``#define``,
``#undef``, ``#ifdef`` / ``#ifndef`` / ``#if`` / ``#elif`` / ``#else`` / ``#endif``.

bpftrace runs clang's preprocessor over the program with the kernel's headers.
ksim takes kernel types from BTF, not from headers, so an ``#include`` brings no
types; it brings the header's object-like ``#define`` constants when the header
can be found in one of the include directories (a kernel's headers package, the
toy's ``include/``), read without running a compiler: only ``#define NAME
value`` lines whose value is an integer expression are taken.
``BPFTRACE_HAVE_BTF`` is defined, as bpftrace defines it when the kernel has BTF,
so that programs take their BTF branch.

The directive lines are blanked (the program keeps its line numbers); the macros
are handed to the parser, which expands an object-like macro where its name stands
as an expression (:class:`Macros`), so that error positions stay those of the
program's text.  Function-like macros are refused by name.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from .errors import Loc, TraceSyntaxError, TraceUnsupported

#: what bpftrace itself defines for every program (with BTF)
PREDEFINED = {"BPFTRACE_HAVE_BTF": "1"}
_DIRECTIVE = re.compile(r"[ \t]*#[ \t]*([A-Za-z_]\w*)?(.*)")
_DEFINE = re.compile(r"([A-Za-z_]\w*)(\()?")
#: at most this many headers are read for one program (an include's includes too)
MAX_HEADERS = 200


@dataclass
class Macros:
    """The object-like macros defined where the program's text is: name -> text."""

    defined: dict[str, str] = field(default_factory=dict)
    #: the headers the program includes, as written
    includes: list[str] = field(default_factory=list)

    def get(self, name: str) -> str | None:
        return self.defined.get(name)


def preprocess(source: str, include_dirs: tuple[Path, ...] = ()) -> tuple[str, Macros]:
    """``source`` with its directive lines blanked, and the macros it defines."""
    macros = Macros(dict(PREDEFINED))
    out: list[str] = []
    #: per open conditional: (this branch is taken, some branch was taken, else seen)
    stack: list[list[bool]] = []
    lines = source.split("\n")
    in_comment = _comment_starts(lines)
    i = 0
    while i < len(lines):
        line = lines[i]
        start = i
        if i == 0 and line.startswith("#!"):
            out.append("")
            i += 1
            continue
        m = _DIRECTIVE.match(line)
        if m is None or in_comment[i]:
            out.append(line if all(s[0] for s in stack) else "")
            i += 1
            continue
        # a directive continues over lines ending in a backslash
        text = line
        while text.endswith("\\") and i + 1 < len(lines):
            i += 1
            text = text[:-1] + " " + lines[i]
        out.extend([""] * (i - start + 1))
        i += 1
        m = _DIRECTIVE.match(text)
        assert m is not None
        word, rest = m.group(1) or "", _strip_comment(m.group(2)).strip()
        loc = Loc(start + 1, 1, len(line) + 1)
        active = all(s[0] for s in stack)
        if word in ("ifdef", "ifndef"):
            name = rest.split()[0] if rest else ""
            if not name:
                raise TraceSyntaxError(f"#{word} needs a macro name", loc)
            taken = (name in macros.defined) == (word == "ifdef")
            stack.append([active and taken, taken, False])
        elif word == "if":
            taken = active and bool(_evaluate(rest, macros, loc))
            stack.append([taken, taken, False])
        elif word == "elif":
            if not stack or stack[-1][2]:
                raise TraceSyntaxError("#elif without #if", loc)
            s = stack[-1]
            outer = all(x[0] for x in stack[:-1])
            taken = outer and not s[1] and bool(_evaluate(rest, macros, loc))
            s[0], s[1] = taken, s[1] or taken
        elif word == "else":
            if not stack or stack[-1][2]:
                raise TraceSyntaxError("#else without #if", loc)
            s = stack[-1]
            s[0], s[1], s[2] = all(x[0] for x in stack[:-1]) and not s[1], True, True
        elif word == "endif":
            if not stack:
                raise TraceSyntaxError("#endif without #if", loc)
            stack.pop()
        elif not active:
            continue
        elif word == "define":
            d = _DEFINE.match(rest)
            if d is None:
                raise TraceSyntaxError("#define needs a macro name", loc)
            if d.group(2):
                raise TraceUnsupported(f"function-like macros are not supported: "
                                       f"#define {d.group(1)}(...)", loc)
            macros.defined[d.group(1)] = rest[d.end():].strip()
        elif word == "undef":
            macros.defined.pop(rest.split()[0] if rest else "", None)
        elif word == "include":
            header = rest.strip()
            if not (len(header) > 2 and header[0] + header[-1] in ('<>', '""')):
                raise TraceSyntaxError(f"#include expects <FILE> or \"FILE\", got {rest!r}", loc)
            macros.includes.append(header[1:-1])
            _harvest(header[1:-1], include_dirs, macros, set())
        elif word in ("pragma", "error", "warning", "line", ""):
            if word == "error":
                raise TraceSyntaxError(f"#error {rest}", loc)
        else:
            raise TraceSyntaxError(f"invalid preprocessing directive #{word}", loc)
    if stack:
        raise TraceSyntaxError("unterminated #if (no #endif)", Loc(len(lines), 1, 2))
    return "\n".join(out), macros


def _comment_starts(lines: list[str]) -> list[bool]:
    """For each line, whether it starts inside a /* comment */ opened on an earlier
    line (one pass over the program)."""
    out: list[bool] = []
    depth = False
    for line in lines:
        out.append(depth)
        pos = 0
        while True:
            if depth:
                end = line.find("*/", pos)
                if end < 0:
                    break
                depth, pos = False, end + 2
            else:
                start = line.find("/*", pos)
                if start < 0 or "//" in line[pos:start]:
                    break
                depth, pos = True, start + 2
    return out


def _strip_comment(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", " ", text)
    return text.split("//")[0]


def _evaluate(expr: str, macros: Macros, loc: Loc) -> int:
    """An #if expression: integers, defined(NAME), macros, C's operators."""
    text = re.sub(r"defined\s*\(\s*([A-Za-z_]\w*)\s*\)|defined\s+([A-Za-z_]\w*)",
                  lambda m: "1" if (m.group(1) or m.group(2)) in macros.defined else "0", expr)
    value = constant(text, macros)
    if value is None:
        raise TraceSyntaxError(f"#if: cannot evaluate {expr.strip()!r}", loc)
    return value


_TOKEN = re.compile(r"\s*(0[xX][0-9a-fA-F]+|\d+|[A-Za-z_]\w*|<<|>>|<=|>=|==|!=|&&|\|\||[-+*/%()~!&|^<>?:])",
                    re.ASCII)
#: binary operators of an #if expression by precedence (C's), loosest first
_BINARY = {"||": 1, "&&": 2, "|": 3, "^": 4, "&": 5, "==": 6, "!=": 6, "<": 7, "<=": 7,
           ">": 7, ">=": 7, "<<": 8, ">>": 8, "+": 9, "-": 9, "*": 10, "/": 10, "%": 10}
#: how deeply an #if expression may nest (parentheses, unary operators, ?:)
MAX_IF_DEPTH = 64
#: macros one constant expression may expand (a macro of macros grows exponentially)
MAX_IF_EXPANSIONS = 1000


class _NotConstant(Exception):
    pass


def _wrap(v: int) -> int:
    """``v`` as C's intmax_t holds it (64 bits, two's complement)."""
    return ((v + (1 << 63)) & ((1 << 64) - 1)) - (1 << 63)


def _apply(op: str, a: int, b: int) -> int:
    if op in ("/", "%"):
        if b == 0:
            raise _NotConstant
        q = abs(a) // abs(b) * (1 if (a < 0) == (b < 0) else -1)     # C truncates
        return _wrap(q if op == "/" else a - q * b)
    if op in ("<<", ">>"):
        if not 0 <= b < 64:
            raise _NotConstant
        return _wrap(a << b) if op == "<<" else a >> b
    return _wrap({"+": a + b, "-": a - b, "*": a * b, "&": a & b, "|": a | b, "^": a ^ b,
                  "==": a == b, "!=": a != b, "<": a < b, "<=": a <= b, ">": a > b,
                  ">=": a >= b, "&&": bool(a) and bool(b), "||": bool(a) or bool(b)}[op])


class _Evaluator:
    """A C integer constant expression over tokens whose names are already values:
    64-bit arithmetic, no recursion deeper than MAX_IF_DEPTH."""

    def __init__(self, tokens: list[str | int]) -> None:
        self.toks, self.i = tokens, 0

    def peek(self) -> str | int | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self) -> str | int:
        tok = self.peek()
        if tok is None:
            raise _NotConstant
        self.i += 1
        return tok

    def expr(self, depth: int) -> int:
        if depth > MAX_IF_DEPTH:
            raise _NotConstant
        cond = self.binary(1, depth)
        if self.peek() != "?":
            return cond
        self.take()
        then = self.expr(depth + 1)
        if self.take() != ":":
            raise _NotConstant
        orelse = self.expr(depth + 1)
        return then if cond else orelse

    def binary(self, level: int, depth: int) -> int:
        left = self.unary(depth)
        while True:
            op = self.peek()
            if not isinstance(op, str) or _BINARY.get(op, 0) < level:
                return left
            self.take()
            right = self.binary(_BINARY[op] + 1, depth)
            left = _apply(op, left, right)

    def unary(self, depth: int) -> int:
        # prefix operators in a loop, applied innermost first
        ops: list[str | int] = []
        while self.peek() in ("-", "+", "~", "!"):
            ops.append(self.take())
        tok = self.take()
        if tok == "(":
            v = self.expr(depth + 1)
            if self.take() != ")":
                raise _NotConstant
        elif isinstance(tok, int):
            v = tok
        else:
            raise _NotConstant
        for op in reversed(ops):
            v = {"-": _wrap(-v), "+": v, "~": _wrap(~v), "!": int(not v)}[str(op)]
        return v


def constant(text: str, macros: Macros, depth: int = 0, budget: list[int] | None = None) -> int | None:
    """The value of a C integer constant expression over the macros (None: not one),
    in 64-bit arithmetic as C's preprocessor computes it."""
    budget = [MAX_IF_EXPANSIONS] if budget is None else budget
    text = _strip_comment(text).strip()
    text = re.sub(r"(?<=[0-9a-fA-F])[uUlL]+\b", "", text)
    pos, out = 0, []
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            return None
        tok = m.group(1)
        pos = m.end()
        value: str | int = tok
        if tok[0].isalpha() or tok[0] == "_":
            inner = macros.get(tok)
            budget[0] -= 1
            if inner is None or depth > 16 or budget[0] < 0:
                # an unknown name in #if is 0 (C); elsewhere it makes no constant
                return None
            v = constant(inner, macros, depth + 1, budget)
            if v is None:
                return None
            value = v
        elif tok[0].isdigit():
            octal = len(tok) > 1 and tok[0] == "0" and tok[1] not in "xX"
            digits = tok[2:] if tok[:2] in ("0x", "0X") else tok
            if len(digits.lstrip("0")) > 22 or (octal and not set(tok) <= set("01234567")):
                return None
            value = int(tok, 8) if octal else int(tok, 0)
            if value >= 1 << 64:
                return None
            value = _wrap(value)
        out.append(value)
    if not out:
        return None
    ev = _Evaluator(out)
    try:
        value = ev.expr(0)
    except _NotConstant:
        return None
    return value if ev.peek() is None else None


def _harvest(header: str, dirs: tuple[Path, ...], macros: Macros, seen: set[Path]) -> None:
    """The integer #define constants of ``header`` and what it includes, found in
    ``dirs``; a header not found brings nothing (its types come from BTF)."""
    for d in dirs:
        path = d / header
        if path.is_file():
            break
    else:
        return
    if path in seen or len(seen) >= MAX_HEADERS:
        return
    seen.add(path)
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return
    for line in re.sub(r"\\\n", " ", text).split("\n"):
        m = _DIRECTIVE.match(line)
        if m is None:
            continue
        word, rest = m.group(1) or "", _strip_comment(m.group(2)).strip()
        if word == "include":
            inc = rest.strip()
            if len(inc) > 2 and inc[0] + inc[-1] in ('<>', '""'):
                _harvest(inc[1:-1], dirs, macros, seen)
        elif word == "define":
            dm = _DEFINE.match(rest)
            if dm is None or dm.group(2) or dm.group(1) in macros.defined:
                continue
            value = rest[dm.end():].strip()
            if value and constant(value, macros) is not None:
                macros.defined[dm.group(1)] = value


def release_include_dirs(release: str) -> tuple[Path, ...]:
    """The include directories of the headers package of kernel ``release`` on this
    machine (Debian's ``linux-headers-RELEASE`` and its ``-common`` half), or none."""
    if not release or "/" in release:
        return ()
    roots = [Path("/usr/src") / f"linux-headers-{release}", Path("/lib/modules") / release / "build"]
    base, _, _flavour = release.rpartition("-")
    if base:
        roots.append(Path("/usr/src") / f"linux-headers-{base}-common")
    out: list[Path] = []
    for root in roots:
        for d in kernel_include_dirs(root):
            if d.resolve() not in (x.resolve() for x in out):
                out.append(d)
    return tuple(out)


def system_include_dirs() -> tuple[Path, ...]:
    """This machine's C headers (``<sys/socket.h>``: AF_INET is Linux's stable ABI)."""
    import sysconfig

    multiarch = sysconfig.get_config_var("MULTIARCH") or ""
    names = ["/usr/local/include", *([f"/usr/include/{multiarch}"] if multiarch else []),
             "/usr/include"]
    return tuple(Path(n) for n in names if Path(n).is_dir())


def kernel_include_dirs(root: Path) -> tuple[Path, ...]:
    """The include directories of a kernel headers tree (``linux-headers-*``)."""
    names = ("arch/x86/include", "arch/x86/include/generated", "include", "arch/x86/include/uapi",
             "arch/x86/include/generated/uapi", "include/uapi", "include/generated/uapi")
    return tuple(root / n for n in names if (root / n).is_dir())


__all__ = ["Macros", "PREDEFINED", "constant", "kernel_include_dirs", "preprocess",
           "release_include_dirs", "system_include_dirs"]
