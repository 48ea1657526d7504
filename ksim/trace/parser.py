"""A recursive-descent parser for the subset of bpftrace's language ``ksim trace``
runs.  The grammar (C's operator precedence, as bpftrace's)::

    program    := [config] probe*
    config     := "config" "=" "{" [NAME "=" INT (";" NAME "=" INT)*] [";"] "}"
    probe      := attach ("," attach)* ["/" expr "/"] block
    attach     := "BEGIN" | "END" | provider ":" FUNC ["+" OFFSET]      (raw text)
    block      := "{" [stmt (";" stmt)*] [";"] "}"
    stmt       := "if" "(" expr ")" block ["else" (if-stmt | block)]
                | lvalue ("=" | "+=" | "-=" | ... ) expr | lvalue ("++" | "--")
                | ("++" | "--") lvalue | expr
    lvalue     := "$" NAME | "@" [NAME] ["[" expr ("," expr)* "]"]
    expr       := lor ["?" expr ":" expr]
    lor        := land ("||" land)*          land := bor ("&&" bor)*
    bor        := bxor ("|" bxor)*           bxor := band ("^" band)*
    band       := equal ("&" equal)*         equal := rel (("==" | "!=") rel)*
    rel        := shift (("<" | "<=" | ">" | ">=") shift)*
    shift      := add (("<<" | ">>") add)*   add := mul (("+" | "-") mul)*
    mul        := unary (("*" | "/" | "%") unary)*
    unary      := ("!" | "~" | "-" | "+") unary | primary
    primary    := INT | STRING | "(" expr ")" | NAME "(" [expr ("," expr)*] ")" | NAME
                | "$" NAME | "@" [NAME] ["[" expr ("," expr)* "]"]
                | "(" TYPE ")" primary                                   (refused: a cast)

Attach points are read as raw text (wildcards, offsets) by the lexer when the
parser asks for one.  Constructs of the full language outside the subset are
recognised and refused by name (TraceUnsupported), so that a user learns what is
missing rather than meeting a bare syntax error.
"""

from __future__ import annotations

import bisect
import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import syntax as t
from .errors import Loc, TraceError, TraceSemanticError, TraceSyntaxError, TraceUnsupported
from .maps import MAX_MAP_KEYS
from .preprocess import Macros, preprocess

#: multi-character punctuation, longest first
PUNCT = ("<<=", ">>=", "==", "!=", "<=", ">=", "<<", ">>", "&&", "||", "++", "--", "+=", "-=",
         "*=", "/=", "%=", "&=", "|=", "^=", "->",
         "{", "}", "(", ")", "[", "]", ",", ";", "?", ":", "/", "+", "-", "*", "%", "&", "|",
         "^", "!", "~", "<", ">", "=", ".", "#")
ASSIGN_OPS = ("=", "+=", "-=", "*=", "/=", "%=", "&=", "|=", "^=", "<<=", ">>=")
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
NUMBER = re.compile(r"0[xX][0-9a-fA-F_]+|[0-9][0-9_]*(?:[eE][0-9]+)?")
#: the largest integer literal (bpftrace's literals are 64-bit unsigned)
MAX_INT = (1 << 64) - 1
#: the smallest value a negated literal or a parameter may have (64-bit signed): below
#: it, masking to 64 bits made a positive number
MIN_INT = -(1 << 63)
#: binary operators by precedence level, loosest first
LEVELS: tuple[tuple[str, ...], ...] = (
    ("||",), ("&&",), ("|",), ("^",), ("&",), ("==", "!="), ("<", "<=", ">", ">="), ("<<", ">>"),
    ("+", "-"), ("*", "/", "%"),
)
#: probe types of bpftrace's language ksim trace does not attach
OTHER_PROVIDERS = {
    "software": "software", "s": "software",
    "hardware": "hardware", "h": "hardware", "watchpoint": "watchpoint",
    "w": "watchpoint", "asyncwatchpoint": "asyncwatchpoint", "aw": "asyncwatchpoint",
    "iter": "iter", "it": "iter", "self": "self",
}
#: user-space probes: outside what ksim instruments
USER_PROVIDERS = {"uprobe": "uprobe", "u": "uprobe", "uretprobe": "uretprobe",
                  "ur": "uretprobe", "usdt": "usdt", "U": "usdt"}
PROVIDERS = {"kprobe": "kprobe", "k": "kprobe", "kretprobe": "kretprobe", "kr": "kretprobe",
             "interval": "interval", "i": "interval", "tracepoint": "tracepoint",
             "t": "tracepoint", "rawtracepoint": "rawtracepoint", "rt": "rawtracepoint",
             "kfunc": "kfunc", "f": "kfunc", "fentry": "kfunc", "kretfunc": "kretfunc",
             "fr": "kretfunc", "fexit": "kretfunc", "profile": "profile", "p": "profile"}
#: units of an interval or profile probe's period, in nanoseconds (hz: a rate)
INTERVAL_UNITS = {"s": 10**9, "ms": 10**6, "us": 10**3, "hz": 0}
#: statement keywords of the full language that the subset lacks
UNSUPPORTED_KEYWORDS = {
    "enum": "enum definitions", "fn": "function definitions", "import": "import",
}
#: a while loop (or a for loop over a range) runs its body at most this many times
#: in a kernel probe's action: the snippets have no backward jump, so a loop is its
#: body copied this many times, each copy run while the loop goes on (bpftrace's
#: verifier bounds loops too); a loop still going after the last copy stops there.
#: unroll's count is at most this too
MAX_LOOP = 100
#: names that start a cast in the full language: "(uint8)x"
TYPE_NAMES = frozenset({
    "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool", "char",
    "short", "int", "long", "unsigned", "signed", "void", "string", "inet", "buffer",
    "u8", "u16", "u32", "u64", "s8", "s16", "s32", "s64", "size_t", "pid_t", "const",
})
#: what follows the "(" of a cast: a struct, union or enum type, or type names, then
#: pointer stars, then ")" -- ``(struct path *)``, ``(uint8)``, ``(unsigned long *)``
_TYPE = "(?:" + "|".join(sorted(TYPE_NAMES)) + r")\b"
CAST = re.compile(r"(?:const\s+)?(?:(?:struct|union|enum)\s+[A-Za-z_]\w*|" + _TYPE
                  + r"(?:\s+" + _TYPE + r")*)\s*(?:\*\s*)*\)")
#: a type as the first argument of offsetof or sizeof, up to "," or ")"
TYPE_ARG = re.compile(r"(?:(?:struct|union)\s+[A-Za-z_]\w*|[A-Za-z_]\w*)\s*(?:\*\s*)*[,)]")
#: settings of a config block: each of bpftrace's names for one ksim knows
CONFIG_NAMES = {"max_map_keys": "max_map_keys", "BPFTRACE_MAX_MAP_KEYS": "max_map_keys",
                "max_strlen": "max_strlen", "BPFTRACE_MAX_STRLEN": "max_strlen",
                "BPFTRACE_STRLEN": "max_strlen"}
#: settings that change nothing ksim does (they tune BPF, user symbols, or output
#: ksim makes the same way): accepted and kept for what they say
IGNORED_CONFIG = frozenset({
    "cache_user_symbols", "cpp_demangle", "lazy_symbolication", "license", "log_size",
    "max_ast_nodes", "max_bpf_progs", "max_cat_bytes", "max_probes",
    "max_type_res_iterations", "missing_probes", "on_stack_limit", "perf_rb_pages",
    "print_maps_on_exit", "show_debug_info", "stack_mode", "str_trunc_trailer",
    "symbol_source", "use_blazesym", "unstable_import", "unstable_macro", "unstable_map_decl",
    "unstable_tseries", "unstable_addr",
})
#: the longest string a program may ask for (bpftrace's max_strlen), bytes
MAX_STRLEN = 1024
#: how deeply expressions and statements may nest: the parser and the passes after
#: it (the compiler, the snippets' check and code generator) walk the tree
#: recursively, and a tree this deep stays well within Python's recursion limit
MAX_DEPTH = 64
TOO_DEEP = f"expressions and blocks nested deeper than {MAX_DEPTH} levels"
#: statements ``unroll`` may make in one program (copies of its body, nested
#: unrolls multiplying)
MAX_UNROLLED = 1_000
#: characters of text object-like macros may expand to in one program (each use of
#: a macro counts its text again: a macro of macros grows exponentially)
MAX_EXPANDED = 1_000_000
#: binary operators' precedence levels, by operator (LEVELS' index)
PRECEDENCE = {op: level for level, ops in enumerate(LEVELS) for op in ops}


@dataclass(frozen=True, slots=True)
class Token:
    kind: str          # "int", "str", "name", "var", "map", "punct", "eof"
    text: str
    loc: Loc
    value: int | str | None = None


def integer(text: str, loc: Loc) -> int:
    """The value of integer literal ``text`` as bpftrace reads it: ``0x`` hexadecimal,
    a leading ``0`` octal (``007``), ``_`` separators, ``1e6`` a decimal coefficient
    times a power of ten; at most 64 bits."""
    digits = text.replace("_", "")
    too_large = out_of_range(f"integer literal {_shown(text)!r}", MAX_INT + 1, loc)
    if digits[:2] in ("0x", "0X"):
        body, base, exp = digits[2:], 16, ""
    else:
        body, _, exp = digits.replace("E", "e").partition("e")
        base = 8 if len(body) > 1 and body[0] == "0" and not exp else 10
        if base == 8 and any(c in "89" for c in body):
            raise TraceSyntaxError(f"invalid octal literal {text!r} (a leading 0 makes an octal "
                                   "number: digits 0 to 7)", loc)
    if not body:
        raise TraceSyntaxError(f"invalid integer literal {text!r}", loc)
    # no conversion of a literal that cannot fit (a 5,000-digit one, 1e999999999)
    if len(body.lstrip("0")) > 22 or len(exp.lstrip("0")) > 2:
        raise too_large
    value = int(body, base) * 10 ** int(exp or "0")
    if value > MAX_INT:
        raise too_large
    return value


def _shown(text: str) -> str:
    return text if len(text) <= 40 else text[:20] + "..." + text[-8:]


def out_of_range(what: str, value: int, loc: Loc | None) -> TraceSyntaxError:
    """The error for ``what`` (a literal, a parameter) whose ``value`` is outside
    MIN_INT..MAX_INT: 64 bits hold neither."""
    side = (f"too large (the largest is {MAX_INT})" if value > MAX_INT
            else f"too small (the smallest is {MIN_INT})")
    return TraceSyntaxError(f"{what} is {side}", loc)


def number_of(text: str) -> int | None:
    """The integer parameter or option ``text`` reads as (``int(text, 0)``), None if it
    reads as none; a decimal past Python's limit on digits (4,300) is past 64 bits."""
    try:
        return int(text, 0)
    except ValueError:
        if re.fullmatch(r"\s*[+-]?[1-9][0-9_]*\s*", text) is None:
            return None
        return MIN_INT - 1 if text.strip().startswith("-") else MAX_INT + 1


def in_range(value: int, what: str, loc: Loc | None) -> int:
    """``value`` as 64 bits (a negative one in two's complement), if it fits."""
    if not MIN_INT <= value <= MAX_INT:
        raise out_of_range(what, value, loc)
    return value & MAX_INT


class TraceLimit(TraceUnsupported):
    """A program past one of ksim's bounds on what it may make the tools build:
    nesting, unrolled statements, macro expansion, printf's width and precision."""

    code = "trace-limit"


class Lexer:
    """Tokens on demand (the parser decides when an attach point comes next)."""

    def __init__(self, source: str) -> None:
        self.src = source
        self.pos = 0
        self.line = 1
        self.line_start = 0

    def loc(self, start: int, end: int, line: int, line_start: int) -> Loc:
        return Loc(line, start - line_start + 1, end - line_start + 1)

    def here(self) -> Loc:
        return self.loc(self.pos, self.pos + 1, self.line, self.line_start)

    def _advance(self, n: int) -> None:
        for c in self.src[self.pos:self.pos + n]:
            if c == "\n":
                self.line += 1
                self.line_start = self.pos + 1
            self.pos += 1

    def skip_space(self) -> None:
        if self.pos == 0 and self.src.startswith("#!"):   # a script's interpreter line
            end = self.src.find("\n")
            self._advance(len(self.src) if end < 0 else end)
        while self.pos < len(self.src):
            c = self.src[self.pos]
            if c in " \t\r\n":
                self._advance(1)
            elif self.src.startswith("//", self.pos):
                end = self.src.find("\n", self.pos)
                self._advance((len(self.src) if end < 0 else end) - self.pos)
            elif self.src.startswith("/*", self.pos):
                end = self.src.find("*/", self.pos + 2)
                if end < 0:
                    raise TraceSyntaxError("unterminated comment", self.here())
                self._advance(end + 2 - self.pos)
            else:
                return

    def attach_text(self) -> Token:
        """The raw text of an attach point: up to white space, ',', '{' or '/'."""
        self.skip_space()
        start, line, line_start = self.pos, self.line, self.line_start
        while self.pos < len(self.src) and self.src[self.pos] not in " \t\r\n,{/":
            self._advance(1)
        text = self.src[start:self.pos]
        return Token("attach", text, self.loc(start, max(self.pos, start + 1), line, line_start))

    def next(self) -> Token:
        self.skip_space()
        start, line, line_start = self.pos, self.line, self.line_start
        if self.pos >= len(self.src):
            return Token("eof", "", self.loc(start, start + 1, line, line_start))
        c = self.src[self.pos]
        kind: str
        value: int | str | None = None
        if "0" <= c <= "9":        # ASCII digits only ("²".isdigit() too)
            m = NUMBER.match(self.src, self.pos)
            assert m is not None
            text = m.group(0)
            self._advance(len(text))
            if self.pos < len(self.src) and (self.src[self.pos].isalnum() or self.src[self.pos] == "_"):
                raise TraceSyntaxError(f"invalid integer literal {text + self.src[self.pos]!r}",
                                       self.loc(start, self.pos + 1, line, line_start))
            kind, value = "int", integer(text, self.loc(start, self.pos, line, line_start))
        elif c == '"':
            kind, value = "str", self._string(start, line, line_start)
        elif c in "$@":
            self._advance(1)
            m = NAME.match(self.src, self.pos) if c == "@" else \
                re.compile(r"[A-Za-z_][A-Za-z0-9_]*|[0-9]+|#").match(self.src, self.pos)
            name = m.group(0) if m else ""
            if c == "$" and not name:
                raise TraceSyntaxError("expected a variable name after '$'",
                                       self.loc(start, self.pos + 1, line, line_start))
            self._advance(len(name))
            kind, value = ("var" if c == "$" else "map"), name
        elif NAME.match(c):
            m = NAME.match(self.src, self.pos)
            assert m is not None
            self._advance(len(m.group(0)))
            kind = "name"
        else:
            for p in PUNCT:
                if self.src.startswith(p, self.pos):
                    self._advance(len(p))
                    kind = "punct"
                    break
            else:
                raise TraceSyntaxError(f"invalid character {c!r}",
                                       self.loc(start, start + 1, line, line_start))
        text = self.src[start:self.pos]
        return Token(kind, text, self.loc(start, self.pos, line, line_start), value)

    def _string(self, start: int, line: int, line_start: int) -> str:
        out: list[str] = []
        self._advance(1)
        escapes = {"n": "\n", "t": "\t", "\\": "\\", '"': '"', "r": "\r", "0": "\0"}
        while True:
            if self.pos >= len(self.src) or self.src[self.pos] == "\n":
                raise TraceSyntaxError("unterminated string", self.loc(start, self.pos, line, line_start))
            c = self.src[self.pos]
            if c == '"':
                self._advance(1)
                return "".join(out)
            if c == "\\" and self.pos + 1 < len(self.src):
                out.append(escapes.get(self.src[self.pos + 1], "\\" + self.src[self.pos + 1]))
                self._advance(2)
            else:
                out.append(c)
                self._advance(1)


class Parser:
    def __init__(self, source: str, filename: str = "stdin", macros: Macros | None = None,
                 params: tuple[str, ...] = ()) -> None:
        self.source = source
        self.filename = filename
        self.lex = Lexer(source)
        self.tok = self.lex.next()
        self.peeked: Token | None = None
        self.prev = self.tok
        self.in_filter = False
        self.macros = macros if macros is not None else Macros()
        #: the values of positional parameters $1, $2, ...
        self.params = params
        #: macros being expanded (a macro naming itself is not expanded again)
        self.expanding: set[str] = set()
        #: how deeply the parser is nested in expressions and blocks (MAX_DEPTH)
        self.depth = 0
        #: what the program used of MAX_UNROLLED and MAX_EXPANDED (shared with the
        #: parsers of macro expansions)
        self.budget = {"unrolled": 0, "expanded": 0}
        #: the source offset of each line's start (a Loc's offset, found by bisect)
        self._line_starts: list[int] | None = None
        #: loops the parser is in (break and continue need one)
        self.loops = 0
        #: ``macro NAME(params) { ... }`` definitions, by name (shared with the parsers
        #: of object-like macros' expansions)
        self.user_macros: dict[str, UserMacro] = {}
        #: expansions of macros so far (their variables are renamed apart by it)
        self.expansions = [0]

    # --- nesting ------------------------------------------------------------------------
    def enter(self, loc: Loc) -> None:
        """One level deeper (``leave`` undoes it); past MAX_DEPTH a TraceLimit."""
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise TraceLimit(TOO_DEEP, loc)

    def leave(self) -> None:
        self.depth -= 1

    # --- tokens -------------------------------------------------------------------------
    def advance(self) -> Token:
        tok = self.prev = self.tok
        if self.peeked is not None:
            self.tok, self.peeked = self.peeked, None
        else:
            self.tok = self.lex.next()
        return tok

    def peek(self) -> Token:
        if self.peeked is None:
            self.peeked = self.lex.next()
        return self.peeked

    def at(self, *texts: str) -> bool:
        return self.tok.kind in ("punct", "name") and self.tok.text in texts

    def expect(self, text: str, what: str | None = None) -> Token:
        if not self.at(text):
            self.fail(f"expecting {what or repr(text)}")
        return self.advance()

    def fail(self, expecting: str) -> None:
        found = "end of file" if self.tok.kind == "eof" else repr(self.tok.text)
        raise TraceSyntaxError(f"syntax error, unexpected {found}, {expecting}", self.tok.loc)

    # --- program ------------------------------------------------------------------------
    def program(self) -> t.Program:
        config: dict[str, int | str] = {}
        if self.at("config") and self.peek().text == "=":
            config = self.config()
        probes = []
        records = []
        while self.tok.kind != "eof":
            if self.at("struct", "union") and self.peek().kind == "name":
                records.append(self.record())
                continue
            if self.at("let") and self.peek().kind == "map":
                self.map_declaration(config)
                continue
            if self.at("macro") and self.peek().kind == "name":
                self.macro_definition()
                continue
            probes.append(self.probe())
        return t.Program(tuple(probes), self.source, self.filename, config,  # type: ignore[arg-type]
                         tuple(records), tuple(self.macros.includes))

    def config(self) -> dict[str, int | str]:
        """``config = { max_map_keys = 10000; ... }`` (bpftrace's config block: first in
        the program; a setting by its own name or its environment variable's)."""
        self.advance()
        self.expect("=")
        self.expect("{", "'{' opening the config block")
        out: dict[str, int | str] = {}
        while not self.at("}"):
            if self.at(";"):
                self.advance()
                continue
            tok = self.tok
            if tok.kind != "name":
                self.fail("expecting a config setting (NAME = VALUE) or '}'")
            self.advance()
            self.expect("=", "'=' after the config setting's name")
            value = self.advance()
            if value.kind not in ("int", "str", "name"):
                raise TraceSyntaxError(f"invalid value {value.text!r} for {tok.text}", value.loc)
            short = tok.text.lower().removeprefix("bpftrace_")
            if tok.text in CONFIG_NAMES:
                key = CONFIG_NAMES[tok.text]
                limit = MAX_MAP_KEYS if key == "max_map_keys" else MAX_STRLEN
                if value.kind != "int" or not 0 < int(value.value or 0) <= limit:
                    raise TraceSemanticError(f"{tok.text} must be an integer from 1 to {limit}",
                                             value.loc)
                out[key] = int(value.value or 0)
            elif short in IGNORED_CONFIG:
                out[short] = value.value if value.kind != "name" else value.text  # type: ignore[assignment]
            else:
                raise TraceSemanticError(f"Unrecognized config variable: {tok.text}", tok.loc)
            if not self.at("}"):
                self.expect(";", "';' or '}'")
        self.advance()
        return out

    def map_declaration(self, config: dict[str, int | str]) -> None:
        """``let @name = hash(N);`` / ``lruhash(N)`` / ``percpuhash(N)``...: the map
        holds N keys (ksim's maps are hashes; the LRU and per-cpu kinds are held as
        plain ones)."""
        self.advance()
        name = self.advance()
        self.expect("=", "'=' in a map declaration")
        kind = self.advance()
        self.expect("(", "'(' after the map's kind")
        n = self.advance()
        self.expect(")", "')' closing the map's size")
        if self.at(";"):
            self.advance()
        if kind.text not in ("hash", "lruhash", "percpuhash", "percpulruhash", "percpuarray"):
            raise TraceSemanticError(f"unknown map kind {kind.text!r}", kind.loc)
        if n.kind != "int" or not 0 < int(n.value or 0) <= MAX_MAP_KEYS:
            raise TraceSemanticError(f"a map's size must be an integer from 1 to {MAX_MAP_KEYS}",
                                     n.loc)
        config[f"keys:@{name.value}"] = int(n.value or 0)

    def record(self) -> tuple[str, str, tuple[tuple[str, str, int | None], ...], Loc]:
        """``struct NAME { TYPE FIELD; TYPE FIELD[N]; ... };``"""
        kind_tok = self.advance()
        name = self.advance()
        if name.kind != "name":
            raise TraceSyntaxError(f"expecting the {kind_tok.text}'s name", name.loc)
        self.expect("{")
        fields: list[tuple[str, str, int | None]] = []
        while not self.at("}"):
            words: list[str] = []
            while not self.at(";", "}", "["):
                tok = self.advance()
                if tok.kind == "eof":
                    self.fail("expecting '}' closing the struct")
                if tok.kind not in ("name", "punct") or (tok.kind == "punct" and tok.text != "*"):
                    raise TraceSyntaxError(f"unexpected {tok.text!r} in a struct member", tok.loc)
                words.append(tok.text)
            count = None
            if self.at("["):
                self.advance()
                n = self.advance()
                if n.kind != "int":
                    raise TraceSyntaxError("an array member needs a constant size", n.loc)
                count = int(n.value or 0)
                self.expect("]")
            if len(words) < 2 or words[-1] == "*":
                raise TraceSyntaxError("a struct member needs a type and a name", self.tok.loc)
            fields.append((" ".join(words[:-1]), words[-1], count))
            self.expect(";", "';' after a struct member")
        self.advance()
        if self.at(";"):
            self.advance()
        return kind_tok.text, name.text, tuple(fields), kind_tok.loc.to(name.loc)

    def probe(self) -> t.Probe:
        if self.at("config") and self.peek().text == "=":
            raise TraceSyntaxError("a config block must come first, before every probe", self.tok.loc)
        if self.tok.kind == "name" and self.tok.text in UNSUPPORTED_KEYWORDS \
                and not self.source.startswith(":", self.lex.pos):
            raise TraceUnsupported(f"{UNSUPPORTED_KEYWORDS[self.tok.text]} are not supported",
                                   self.tok.loc)
        start = self.tok.loc
        # the current token was lexed as an ordinary token: re-read it as an attach point
        self.lex.pos, self.lex.line = self._offset(start), start.line
        self.lex.line_start = self.lex.pos - (start.col - 1)
        self.peeked = None
        points = [self.attach_point(self.lex.attach_text())]
        self.tok = self.lex.next()
        while self.at(","):
            points.append(self.attach_point(self.lex.attach_text()))
            self.tok = self.lex.next()
        pred = None
        if self.at("/"):
            self.advance()
            self.in_filter = True
            pred = self.expr()
            self.in_filter = False
            self.expect("/", "'/' closing the filter")
        if not self.at("{"):
            self.fail("expecting '{' (an action block)")
        body = self.block()
        check_depth(((pred,) if pred is not None else ()) + body)
        return t.Probe(tuple(points), pred, body, start)

    def _offset(self, loc: Loc) -> int:
        """The source offset of ``loc``'s start."""
        return self._starts()[loc.line - 1] + loc.col - 1

    def _starts(self) -> list[int]:
        if self._line_starts is None:
            self._line_starts = [0, *(m.end() for m in re.finditer("\n", self.source))]
        return self._line_starts

    def _line_of(self, offset: int) -> tuple[int, int]:
        """(1-based line, the line's start offset) of source ``offset``."""
        starts = self._starts()
        line = bisect.bisect_right(starts, offset)
        return line, starts[line - 1]

    def attach_point(self, tok: Token) -> t.AttachPoint:
        text, loc = tok.text, tok.loc
        if not text:
            raise TraceSyntaxError("syntax error, expecting an attach point", loc)
        if text in ("BEGIN", "END", "begin", "end"):
            return t.AttachPoint(text.upper(), text=text, loc=loc)
        provider, colon, rest = text.partition(":")
        if not colon:
            raise TraceSyntaxError(f"invalid attach point {text!r}: expecting PROVIDER:FUNCTION, "
                                   "BEGIN or END", loc)
        if provider in USER_PROVIDERS:
            raise TraceUnsupported(f"{USER_PROVIDERS[provider]} probes are not supported: they "
                                   "instrument user space, and ksim splices the kernel's code",
                                   loc)
        if provider in OTHER_PROVIDERS:
            raise TraceUnsupported(f"{OTHER_PROVIDERS[provider]} probes are not supported "
                                   "(kprobe, kretprobe, kfunc, kretfunc, tracepoint, "
                                   "rawtracepoint, profile, interval, BEGIN and END are)", loc)
        if provider not in PROVIDERS:
            raise TraceSyntaxError(f"Invalid probe type: {provider}", loc)
        kind = PROVIDERS[provider]
        if kind in ("interval", "profile"):
            return t.AttachPoint(kind, text=text, loc=loc, period_ns=self._period(kind, rest, loc))
        if kind == "tracepoint":
            category, colon, name = rest.partition(":")
            if not colon or not category or not name or not all(
                    re.fullmatch(r"[A-Za-z0-9_*?\[\]!-]+", x) for x in (category, name)):
                raise TraceSyntaxError(f"invalid tracepoint {text!r}: expecting "
                                       "tracepoint:CATEGORY:NAME", loc)
            return t.AttachPoint(kind, name, None, text, loc, category=category)
        module = ""
        if ":" in rest:
            module, _, rest = rest.partition(":")
            if kind in ("kprobe", "kretprobe") and module:
                raise TraceUnsupported(f"{kind} with a module (MODULE:FUNCTION) is not supported",
                                       loc)
        func, plus, offset_text = rest.partition("+")
        if not func or not re.fullmatch(r"[A-Za-z0-9_.*?\[\]!-]+", func):
            raise TraceSyntaxError(f"invalid function name {func!r} in {text!r}", loc)
        offset = None
        if plus:
            if kind != "kprobe":
                raise TraceSemanticError(f"Offset not allowed for {kind}", loc)
            if any(c in func for c in "*?["):
                raise TraceSemanticError("Offset not allowed with a wildcard", loc)
            try:
                offset = int(offset_text, 0)
            except ValueError:
                raise TraceSyntaxError(f"invalid offset {offset_text!r}", loc) from None
        return t.AttachPoint(kind, func, offset, text, loc, category=module)

    @staticmethod
    def _period(kind: str, rest: str, loc: Loc) -> int:
        """An interval's or a profile's period in ns: ``s:1``, ``ms:100``, ``hz:99``,
        ``1s``, ``100ms``, ``99hz``."""
        unit, colon, count = rest.partition(":")
        if not colon:
            m = re.fullmatch(r"([0-9]+)([a-z]+)", rest)
            unit, count = (m.group(2), m.group(1)) if m else ("", "")
        if unit not in INTERVAL_UNITS or not re.fullmatch("[0-9]{1,18}", count) \
                or int(count) == 0:
            raise TraceSyntaxError(f"invalid {kind} probe '{kind}:{rest}': expecting {kind}:s:N, "
                                   f"{kind}:ms:N, {kind}:us:N, {kind}:hz:N or {kind}:Ns "
                                   "(0 < N < 10^18)", loc)
        n = int(count)
        if unit == "hz":
            if n > 10**9:
                raise TraceSyntaxError(f"{kind}:hz:{n} is faster than one per nanosecond", loc)
            return 10**9 // n
        return n * INTERVAL_UNITS[unit]

    # --- statements ------------------------------------------------------------------------
    def block(self) -> tuple[t.Stmt, ...]:
        self.enter(self.tok.loc)
        try:
            return self._block()
        finally:
            self.leave()

    def _block(self) -> tuple[t.Stmt, ...]:
        self.expect("{")
        stmts: list[t.Stmt] = []
        while not self.at("}"):
            if self.tok.kind == "eof":
                self.fail("expecting '}'")
            if self.at(";"):
                self.advance()
                continue
            several = self.statements()
            stmts.extend(several)
            if self.prev.text == "}" or self.at("}"):   # a statement ending in a block
                continue
            self.expect(";", "';' or '}'")
        self.advance()
        return tuple(stmts)

    def statements(self) -> list[t.Stmt]:
        """One statement, or the several one source statement stands for (``let $x =
        e`` declares and assigns; ``unroll (N) { ... }`` is its body N times)."""
        tok = self.tok
        if tok.kind == "name" and tok.text == "let":
            self.advance()
            var = self.tok
            if var.kind != "var":
                self.fail("expecting a variable ($name) after let")
            self.advance()
            self.scratch_name(var)
            type_text = None
            if self.at(":"):
                self.advance()
                type_text = self.type_text(("=", ";", "}"))
            out: list[t.Stmt] = [t.Declare(var.loc, str(var.value), type_text)]
            if self.at("="):
                self.advance()
                value = self.expr()
                out.append(t.Assign(var.loc.to(value.loc), t.Scratch(var.loc, str(var.value)),
                                    "=", value))
            return out
        if tok.kind == "name" and tok.text == "unroll":
            self.advance()
            self.expect("(", "'(' after unroll")
            n = self.expr()
            self.expect(")", "')' closing the count")
            if not isinstance(n, t.Int) or not 1 <= n.value <= MAX_LOOP:
                raise TraceSemanticError(f"unroll needs a constant count from 1 to {MAX_LOOP}",
                                         n.loc)
            body = self.loop_body(tok, n.value)
            if _jumps(body):
                # a break or continue needs the loop's own flags: a loop of N passes
                return [t.While(tok.loc, t.Int(tok.loc, 1), body, bound=n.value)]
            return [s for _ in range(n.value) for s in body]
        if tok.kind == "name" and tok.text == "for":
            return self.for_range()
        if tok.kind == "name" and tok.text in self.user_macros and self.peek().text == "(":
            return self.expand_macro(self.advance(), statement=True)
        if self.at("{"):
            # a nested block: its statements, in the same scope (as if (1) { ... })
            return [t.If(tok.loc, t.Int(tok.loc, 1), self.block())]
        return [self.statement()]

    def loop_body(self, tok: Token, passes: int) -> tuple[t.Stmt, ...]:
        """A loop's block (break and continue allowed in it); its ``passes`` copies
        count towards MAX_UNROLLED."""
        self.loops += 1
        try:
            body = self.block()
        finally:
            self.loops -= 1
        if self.loops:
            return body         # counted with the loop it is in, pass by pass
        self.budget["unrolled"] += passes * emitted_count(body)
        if self.budget["unrolled"] > MAX_UNROLLED:
            raise TraceLimit(f"loops make more than {MAX_UNROLLED} statements in the program "
                             f"(a loop counts its body once per pass: {passes})", tok.loc)
        return body

    def for_range(self) -> list[t.Stmt]:
        """``for $i : A..B { ... }``: $i from A up to B (excluded), as ``$i = A; while
        ($i < B) { ...; $i++ }`` with the increment run after a continue too; as many
        passes as B - A when both are constants, else at most MAX_LOOP."""
        tok = self.advance()
        paren = self.at("(")
        if paren:
            self.advance()
        var = self.tok
        if var.kind != "var":
            self.fail("expecting a variable ($name) after for")
        self.advance()
        if self.at(","):
            raise TraceUnsupported("for loops over a map's entries bind one variable, the "
                                   "(key, value) tuple; two are not supported: for ($kv : @m) "
                                   "{ ... $kv.0 ... $kv.1 }", tok.loc)
        self.expect(":", "':' after the loop's variable")
        if self.tok.kind == "map":
            ref = self.map_ref()
            if ref.keys:
                raise TraceSemanticError("for loops over a map's entries take the map without "
                                         "keys", ref.loc)
            if paren:
                self.expect(")", "')' closing the loop's map")
            self.scratch_name(var)
            body = self.loop_body(tok, 1)
            return [t.ForMap(tok.loc, str(var.value), ref, body)]
        lo = self.expr()
        self.expect(".", "'..' between the range's bounds")
        self.expect(".", "'..' between the range's bounds")
        hi = self.expr()
        if paren:
            self.expect(")", "')' closing the range")
        a, b = _constant_of(lo), _constant_of(hi)
        passes = MAX_LOOP if a is None or b is None else max(0, min(MAX_LOOP, b - a))
        body = self.loop_body(tok, passes)
        name = str(var.value)
        i = t.Scratch(var.loc, name)
        step = (t.Assign(var.loc, i, "+=", t.Int(var.loc, 1)),)
        cond = t.Binary(hi.loc, "<", i, hi)
        return [t.Assign(var.loc.to(lo.loc), i, "=", lo),
                t.While(tok.loc, cond, body, step, bound=passes)]

    # --- macros ---------------------------------------------------------------------------
    def macro_definition(self) -> None:
        """``macro NAME(p, @m, $v) { statements [expression] }`` (bpftrace's newer
        macros): kept, and expanded where it is called."""
        start = self.advance()
        name = self.advance()
        if name.text in self.user_macros:
            raise TraceSemanticError(f"macro {name.text} is defined twice", name.loc)
        self.expect("(", "'(' after the macro's name")
        params: list[Token] = []
        while not self.at(")"):
            p = self.advance()
            if p.kind not in ("name", "var", "map"):
                raise TraceSyntaxError(f"unexpected {p.text!r} in a macro's parameters", p.loc)
            params.append(p)
            if not self.at(")"):
                self.expect(",", "',' or ')'")
        self.advance()
        self.expect("{", "'{' opening the macro's body")
        stmts: list[t.Stmt] = []
        value: t.Expr | None = None
        while not self.at("}"):
            if self.tok.kind == "eof":
                self.fail("expecting '}' closing the macro")
            if self.at(";"):
                self.advance()
                continue
            several = self.statements()
            if self.at("}") and len(several) == 1 and isinstance(several[0], t.ExprStmt) \
                    and self.prev.text != ";":
                value = several[0].expr        # the last expression, without ';': the value
                break
            stmts.extend(several)
            if self.prev.text == "}" or self.at("}"):
                continue
            self.expect(";", "';' or '}'")
        self.expect("}")
        self.user_macros[name.text] = UserMacro(name.text, tuple(params), tuple(stmts), value,
                                                start.loc.to(name.loc))

    def expand_macro(self, name: Token, statement: bool) -> list[t.Stmt]:
        """A call of a macro: its body with the arguments in place of its parameters,
        its own variables renamed apart (a statement), or its value (an expression)."""
        macro = self.user_macros[name.text]
        args: list[t.Expr] = []
        if self.at("("):
            self.advance()
            while not self.at(")"):
                args.append(self.expr())
                if not self.at(")"):
                    self.expect(",", "',' or ')' in the macro's arguments")
            self.advance()
        if len(args) != len(macro.params):
            raise TraceSemanticError(f"macro {name.text} takes {len(macro.params)} argument"
                                     f"{'s' if len(macro.params) != 1 else ''} ({len(args)} "
                                     "given)", name.loc)
        self.expansions[0] += 1
        env = _MacroEnv(f"{name.text}.{self.expansions[0]}")
        for p, a in zip(macro.params, args, strict=True):
            if p.kind == "map":
                if not isinstance(a, t.MapRef) or a.keys:
                    raise TraceSemanticError(f"macro {name.text}'s parameter {p.text} takes a map "
                                             "(@name)", a.loc)
                env.maps["@" + str(p.value)] = a.name
            elif p.kind == "var":
                env.vars[str(p.value)] = a
            else:
                env.values[p.text] = a
        body = [_substitute(s, env) for s in macro.body]
        value = _substitute(macro.value, env) if macro.value is not None else None
        if statement:
            if value is not None:
                body.append(t.ExprStmt(value.loc, value))
            return body
        if body:
            raise TraceUnsupported(f"macro {name.text} has statements: it is called as a "
                                   "statement, not in an expression", name.loc)
        if value is None:
            raise TraceSemanticError(f"macro {name.text} has no value (its body does not end "
                                     "in an expression)", name.loc)
        return [t.ExprStmt(value.loc, value)]

    def getopt(self, call: t.Call) -> t.Expr:
        """``getopt("NAME", DEFAULT [, "help"])``: the program's argument ``--NAME=VALUE``
        (``--NAME`` alone: true), else DEFAULT; the value read as DEFAULT's kind (an
        integer, a string, or a boolean: true/false/1/0)."""
        if not 1 <= len(call.args) <= 3 or not isinstance(call.args[0], t.Str):
            raise TraceSemanticError("getopt() takes an option's name, a default and a help "
                                     "text", call.loc)
        name = call.args[0].value
        default = call.args[1] if len(call.args) > 1 else t.Int(call.loc, 0)
        if not isinstance(default, t.Int | t.Str):
            raise TraceSemanticError("getopt()'s default is a literal (integer, string, true "
                                     "or false)", default.loc)
        given: str | None = None
        for p in self.params:
            if p == f"--{name}":
                given = "true"
            elif p.startswith(f"--{name}="):
                given = p[len(name) + 3:]
        if given is None:
            return dataclasses.replace(default, loc=call.loc)
        if isinstance(default, t.Str):
            return t.Str(call.loc, given)
        if given.lower() in ("true", "false"):
            return t.Int(call.loc, int(given.lower() == "true"))
        value = number_of(given)
        if value is None:
            raise TraceSemanticError(f"option --{name}={given}: expecting an integer", call.loc)
        return t.Int(call.loc, in_range(value, f"option --{name}={_shown(given)}", call.loc))

    def type_text(self, stop: tuple[str, ...]) -> str:
        """A type's C spelling, up to one of ``stop``."""
        words = []
        while not self.at(*stop) and self.tok.kind != "eof":
            tok = self.advance()
            if tok.kind not in ("name", "punct") or (tok.kind == "punct" and tok.text not in "*[]"):
                raise TraceSyntaxError(f"unexpected {tok.text!r} in a type", tok.loc)
            words.append(tok.text)
        if not words:
            self.fail("expecting a type")
        return " ".join(words)

    def statement(self) -> t.Stmt:
        tok = self.tok
        if tok.kind == "name" and tok.text in UNSUPPORTED_KEYWORDS:
            raise TraceUnsupported(f"{UNSUPPORTED_KEYWORDS[tok.text]} are not supported", tok.loc)
        if tok.kind == "name" and tok.text == "if":
            return self.if_statement()
        if tok.kind == "name" and tok.text == "while":
            self.advance()
            self.expect("(", "'(' after while")
            cond = self.expr()
            self.expect(")", "')' closing the condition")
            body = self.loop_body(tok, MAX_LOOP)
            return t.While(tok.loc, cond, body)
        if tok.kind == "name" and tok.text in ("break", "continue"):
            self.advance()
            if not self.loops:
                raise TraceSemanticError(f"{tok.text} outside a loop (while, for, unroll)",
                                         tok.loc)
            return t.Break(tok.loc) if tok.text == "break" else t.Continue(tok.loc)
        if tok.kind == "name" and tok.text == "return" and self.peek().text in (";", "}"):
            self.advance()
            return t.Return(tok.loc)
        if self.at("++", "--"):
            op = self.advance()
            target = self.lvalue()
            return t.Assign(op.loc.to(target.loc), target, "+=" if op.text == "++" else "-=",
                            t.Int(op.loc, 1))
        if tok.kind in ("var", "map"):
            target = self.lvalue()
            if self.at(*ASSIGN_OPS):
                op = self.advance()
                value = self.expr()
                return t.Assign(target.loc.to(value.loc), target, op.text, value)
            if self.at("++", "--"):
                op = self.advance()
                return t.Assign(target.loc.to(op.loc), target, "+=" if op.text == "++" else "-=",
                                t.Int(op.loc, 1))
            expr = self.continue_expr(target)
            return t.ExprStmt(expr.loc, expr)
        expr = self.expr()
        if self.at(*ASSIGN_OPS):
            raise TraceSemanticError("only a map (@name) or a variable ($name) can be assigned",
                                      expr.loc)
        return t.ExprStmt(expr.loc, expr)

    def if_statement(self) -> t.If:
        start = self.advance().loc
        cond = self.expr()      # "if (c)" or, as newer bpftrace, "if c"
        then = self.block()
        orelse: tuple[t.Stmt, ...] = ()
        if self.at("else"):
            self.advance()
            if self.at("if"):
                self.enter(self.tok.loc)
                try:
                    orelse = (self.if_statement(),)
                finally:
                    self.leave()
            else:
                orelse = self.block()
        if isinstance(cond, t.Int):
            # a constant condition (getopt's, a macro's): the branch never taken is
            # dropped, as bpftrace's optimiser drops it
            then, orelse = (then, ()) if cond.value else ((), orelse)
        return t.If(start, cond, then, orelse)

    def lvalue(self) -> t.MapRef | t.Scratch:
        tok = self.tok
        if tok.kind == "var":
            self.advance()
            self.scratch_name(tok)
            return t.Scratch(tok.loc, str(tok.value))
        if tok.kind == "map":
            return self.map_ref()
        self.fail("expecting a map (@name) or a variable ($name)")
        raise AssertionError

    def scratch_name(self, tok: Token) -> None:
        if str(tok.value).isdigit() or tok.value == "#":
            raise TraceUnsupported(f"positional parameters ({tok.text}) are not supported", tok.loc)

    def map_ref(self) -> t.MapRef:
        tok = self.advance()
        name = "@" + str(tok.value)
        keys: list[t.Expr] = []
        loc = tok.loc
        if self.at("["):
            self.advance()
            keys.append(self.expr())
            while self.at(","):
                self.advance()
                keys.append(self.expr())
            loc = loc.to(self.expect("]", "']' closing the map's keys").loc)
        return t.MapRef(loc, name, tuple(keys))

    # --- expressions -----------------------------------------------------------------------
    def continue_expr(self, first: t.Expr) -> t.Expr:
        """An expression statement that began with a map or variable already read."""
        return self.ternary(self.binary(0, self.postfix(first)))

    def expr(self) -> t.Expr:
        self.enter(self.tok.loc)
        try:
            return self.ternary(self.binary(0))
        finally:
            self.leave()

    def ternary(self, cond: t.Expr) -> t.Expr:
        if not self.at("?"):
            return cond
        self.advance()
        then = self.expr()
        self.expect(":", "':' of the conditional expression")
        orelse = self.expr()
        return t.Ternary(cond.loc.to(orelse.loc), cond, then, orelse)

    def binary(self, level: int, first: t.Expr | None = None) -> t.Expr:
        """Binary operators of precedence ``level`` or tighter, by precedence climbing
        (a chain ``1 + 2 + ...`` is a loop, not a recursion; each operator of a
        tighter level recurses once)."""
        left = first if first is not None else self.unary()
        while self.tok.kind == "punct" and self.tok.text in PRECEDENCE:
            op_level = PRECEDENCE[self.tok.text]
            if op_level < level:
                break
            if self.in_filter and self.at("/") and self.peek().text == "{":
                break       # the '/' closing a filter, not a division
            op = self.advance().text
            right = self.binary(op_level + 1)
            left = t.Binary(left.loc.to(right.loc), op, left, right)
        return left

    def unary(self) -> t.Expr:
        """Prefix operators (read in a loop, applied innermost first) and the operand."""
        prefixes: list[Token] = []
        while True:
            tok = self.tok
            if self.at("!", "~", "-", "+", "*"):
                prefixes.append(self.advance())
                continue
            if self.at("&"):
                raise TraceUnsupported("taking an address (&expr) is not supported", tok.loc)
            if self.at("++", "--"):
                raise TraceUnsupported(f"{tok.text} inside an expression is not supported "
                                       "(use it as a statement)", tok.loc)
            break
        operand = self.postfix(self.primary())
        for tok in reversed(prefixes):
            if tok.text == "-" and type(operand) is t.Int and operand.value > -MIN_INT:
                # -9223372036854775809 does not fit 64 bits, as 18446744073709551616 does not
                raise out_of_range(f"integer literal '-{operand.value}'", -operand.value,
                                   tok.loc.to(operand.loc))
            operand = t.Deref(tok.loc.to(operand.loc), operand) if tok.text == "*" else \
                t.Unary(tok.loc.to(operand.loc), tok.text, operand)
        return operand

    def postfix(self, expr: t.Expr) -> t.Expr:
        while True:
            if self.at(".", "->"):
                if self.at(".") and self.source.startswith(".", self.lex.pos) \
                        and self.peeked is None:
                    break       # a range's "..", not a field
                arrow = self.advance().text == "->"
                name = self.tok
                if name.kind not in ("name", "int"):
                    self.fail("expecting a field name")
                self.advance()
                expr = t.Field(expr.loc.to(name.loc), expr, name.text, arrow)
            elif self.at("["):
                self.advance()
                index = self.expr()
                end = self.expect("]", "']' closing the index").loc
                expr = t.Index(expr.loc.to(end), expr, index)
            else:
                break
        if self.at("++", "--"):
            raise TraceUnsupported(f"{self.tok.text} inside an expression is not supported "
                                   "(use it as a statement)", self.tok.loc)
        return expr

    def primary(self) -> t.Expr:
        tok = self.tok
        if tok.kind == "int":
            self.advance()
            assert isinstance(tok.value, int)
            return t.Int(tok.loc, tok.value)
        if tok.kind == "str":
            self.advance()
            return t.Str(tok.loc, str(tok.value))
        if tok.kind == "var":
            self.advance()
            if str(tok.value).isdigit() or tok.value == "#":
                return self.positional(tok)
            return t.Scratch(tok.loc, str(tok.value))
        if tok.kind == "map":
            return self.map_ref()
        if self.at("("):
            self.advance()
            if self.tok.kind == "name":
                cast = self.cast(tok)
                if cast is not None:
                    return cast
            inner = self.expr()
            if self.at(","):
                items = [inner]
                while self.at(","):
                    self.advance()
                    items.append(self.expr())
                end = self.expect(")", "')' closing the tuple").loc
                return t.Tuple(tok.loc.to(end), tuple(items))
            self.expect(")", "')'")
            return inner
        if tok.kind == "name":
            if tok.text in UNSUPPORTED_KEYWORDS:
                raise TraceUnsupported(f"{UNSUPPORTED_KEYWORDS[tok.text]} are not supported", tok.loc)
            if tok.text in ("sizeof", "offsetof") and self.peek().text == "(":
                return self.size_or_offset()
            macro = self.macros.get(tok.text)
            if macro is not None and tok.text not in self.expanding and self.peek().text != "(":
                self.advance()
                return self.expand(tok, macro)
            if tok.text in self.user_macros:
                stmt = self.expand_macro(self.advance(), statement=False)[0]
                assert isinstance(stmt, t.ExprStmt)
                return stmt.expr
            if tok.text in ("true", "false") and self.peek().text != "(":
                self.advance()
                return t.Int(tok.loc, int(tok.text == "true"))
            self.advance()
            if self.at("("):
                self.advance()
                args: list[t.Expr] = []
                if not self.at(")"):
                    args.append(self.expr())
                    while self.at(","):
                        self.advance()
                        args.append(self.expr())
                end = self.expect(")", "')' closing the call").loc
                call = t.Call(tok.loc.to(end), tok.text, tuple(args), tok.loc)
                if call.name == "getopt":
                    return self.getopt(call)
                if call.name == "str" and args and isinstance(args[0], t.Param):
                    # str($1): the parameter as given, a string
                    text = args[0].text
                    if len(args) == 2 and isinstance(args[1], t.Int):
                        text = text[:max(0, args[1].value - 1)]
                    return t.Str(call.loc, text)
                return call
            return t.Builtin(tok.loc, tok.text)
        self.fail("expecting an expression")
        raise AssertionError


    def cast(self, paren: Token) -> t.Expr | None:
        """``(TYPE)operand`` when what follows the "(" is a type, else None (a
        parenthesised expression)."""
        at = self._offset(self.tok.loc)
        m = CAST.match(self.source, at)
        if m is None:
            return None
        text = " ".join(self.source[at:m.end() - 1].split())
        # jump the lexer past the ")" and read the operand
        self.lex.pos = m.end()
        self.lex.line, self.lex.line_start = self._line_of(m.end())
        self.peeked = None
        self.tok = self.lex.next()
        self.enter(paren.loc)
        try:
            operand = self.unary()
        finally:
            self.leave()
        return t.Cast(paren.loc.to(operand.loc), text, operand)

    def size_or_offset(self) -> t.Expr:
        """``sizeof(TYPE)``, ``sizeof(expr)``, ``offsetof(TYPE, a.b)``."""
        word = self.advance()
        self.expect("(")
        at = self._offset(self.tok.loc)
        m = CAST.match(self.source, at) or TYPE_ARG.match(self.source, at)
        if word.text == "offsetof":
            if m is None or not self.source[at:m.end()].rstrip(")").rstrip():
                m = TYPE_ARG.match(self.source, at)
            if m is None:
                self.fail("expecting a struct type")
            assert m is not None
            type_text = " ".join(self.source[at:m.end() - 1].split()).rstrip(",").strip()
            self._skip_to(m.end() - 1)
            self.expect(",", "',' after the type")
            path = [self.advance().text]
            while self.at("."):
                self.advance()
                path.append(self.advance().text)
            end = self.expect(")", "')' closing offsetof").loc
            return t.OffsetOf(word.loc.to(end), type_text, tuple(path))
        if m is not None and self.source[m.end() - 1] == ")":
            type_text = " ".join(self.source[at:m.end() - 1].split())
            self._skip_to(m.end())
            return t.SizeOf(word.loc.to(self.prev.loc), type_text, None)
        operand = self.expr()
        end = self.expect(")", "')' closing sizeof").loc
        return t.SizeOf(word.loc.to(end), None, operand)

    def _skip_to(self, offset: int) -> None:
        """Go on lexing from source ``offset`` (past text read by a pattern)."""
        self.lex.pos = offset
        self.lex.line, self.lex.line_start = self._line_of(offset)
        self.peeked = None
        self.prev = self.tok
        self.tok = self.lex.next()

    def positional(self, tok: Token) -> t.Expr:
        """``$1``.. (the program's arguments: an integer when it reads as one, else a
        string; missing, 0 or "", as bpftrace) and ``$#`` (how many)."""
        if tok.value == "#":
            return t.Int(tok.loc, len(self.params))
        digits = str(tok.value).lstrip("0") or "0"
        n = int(digits) if len(digits) <= 6 else 10**6     # beyond any parameter: missing
        if n == 0:
            raise TraceSemanticError("$0 is not a positional parameter (they start at $1)", tok.loc)
        value = self.params[n - 1] if n <= len(self.params) else ""
        number = number_of(value)
        if number is None:
            return t.Str(tok.loc, value) if value else t.Param(tok.loc, 0, "")
        return t.Param(tok.loc, in_range(number, f"parameter {tok.text} ({_shown(value)!r})",
                                         tok.loc), value)

    def expand(self, name: Token, text: str) -> t.Expr:
        """An object-like macro's replacement, parsed as an expression located at its
        name."""
        if not text.strip():
            raise TraceSemanticError(f"macro {name.text} expands to nothing", name.loc)
        self.budget["expanded"] += len(text) + 16
        if self.budget["expanded"] > MAX_EXPANDED:
            raise TraceLimit(f"macros expand to more than {MAX_EXPANDED} characters in the "
                             "program", name.loc)
        inner = Parser(text, self.filename, self.macros, self.params)
        inner.user_macros, inner.expansions = self.user_macros, self.expansions
        inner.expanding = self.expanding | {name.text}
        inner.depth, inner.budget = self.depth, self.budget
        try:
            value = inner.expr()
            if inner.tok.kind != "eof":
                inner.fail("expecting the end of the macro")
            check_depth((value,), MAX_DEPTH - self.depth)
        except TraceLimit as exc:
            raise TraceLimit(exc.message, name.loc) from None
        except TraceError as exc:
            raise TraceSemanticError(f"in macro {name.text} ({text.strip()}): {exc.message}",
                                     name.loc) from None
        return _relocate(value, name.loc)


def _children(node: t.Expr | t.Stmt) -> list[t.Expr | t.Stmt]:
    out: list[t.Expr | t.Stmt] = []
    for name in _FIELDS.get(type(node)) or _fields(type(node)):
        v = getattr(node, name)
        if isinstance(v, t.Expr | t.Stmt):
            out.append(v)
        elif isinstance(v, tuple):
            out += [x for x in v if isinstance(x, t.Expr | t.Stmt)]
    return out


_FIELDS: dict[type, tuple[str, ...]] = {}


def _fields(cls: type) -> tuple[str, ...]:
    _FIELDS[cls] = tuple(f.name for f in dataclasses.fields(cls) if f.name != "loc")
    return _FIELDS[cls]


def check_depth(nodes: tuple[t.Expr | t.Stmt, ...], limit: int = MAX_DEPTH) -> None:
    """A TraceLimit at the first node nested deeper than ``limit`` (statements and
    expressions alike: ``1 + 1 + ... + 1`` is as deep as it is long), found without
    recursion."""
    stack: list[tuple[t.Expr | t.Stmt, int]] = [(n, 1) for n in nodes]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            raise TraceLimit(TOO_DEEP, node.loc)
        stack += [(c, depth + 1) for c in _children(node)]


def statement_count(stmts: tuple[t.Stmt, ...] | list[t.Stmt]) -> int:
    """Statements in ``stmts``, those nested in them included."""
    n, stack = 0, list(stmts)
    while stack:
        s = stack.pop()
        n += 1
        if isinstance(s, t.If):
            stack += [*s.then, *s.orelse]
        elif isinstance(s, t.While):
            stack += [*s.body, *s.step]
        elif isinstance(s, t.ForMap):
            stack += list(s.body)
    return n


def emitted_count(stmts: tuple[t.Stmt, ...]) -> int:
    """Statements ``stmts`` stand for once loops are copied pass by pass (a loop
    counts its body once per pass it may make)."""
    n = 0
    for s in stmts:
        n += 1
        if isinstance(s, t.If):
            n += emitted_count(s.then) + emitted_count(s.orelse)
        elif isinstance(s, t.While):
            n += (MAX_LOOP if s.bound is None else s.bound) * emitted_count(s.body + s.step)
        elif isinstance(s, t.ForMap):
            n += emitted_count(s.body)      # run by the client, never copied
    return n


def _jumps(stmts: tuple[t.Stmt, ...]) -> bool:
    """Whether ``stmts`` break or continue their loop (not one nested in them)."""
    for s in stmts:
        if isinstance(s, t.Break | t.Continue):
            return True
        if isinstance(s, t.If) and _jumps(s.then + s.orelse):
            return True
    return False


def _constant_of(e: t.Expr) -> int | None:
    """``e``'s value when it is a constant: a literal, cast or negated."""
    if isinstance(e, t.Int):
        return e.value
    if isinstance(e, t.Cast):
        return _constant_of(e.operand)
    if isinstance(e, t.Unary) and e.op == "-":
        v = _constant_of(e.operand)
        return None if v is None else -v
    return None


@dataclass(frozen=True)
class UserMacro:
    """A ``macro NAME(params) { ... }`` definition: its statements, and its value (the
    body's last expression without a ';'), parsed where it is defined."""

    name: str
    params: tuple[Token, ...]
    body: tuple[t.Stmt, ...]
    value: t.Expr | None
    loc: Loc


@dataclass
class _MacroEnv:
    """One expansion: what each parameter stands for, and the suffix that renames the
    macro's own variables apart from the caller's."""

    suffix: str
    maps: dict[str, str] = dataclasses.field(default_factory=dict)
    vars: dict[str, t.Expr] = dataclasses.field(default_factory=dict)
    values: dict[str, t.Expr] = dataclasses.field(default_factory=dict)


def _substitute(node: Any, env: _MacroEnv) -> Any:
    """``node`` with a macro's parameters replaced by their arguments and its own
    variables renamed (``$x`` as ``$x.NAME.N``)."""
    if isinstance(node, tuple):
        return tuple(_substitute(x, env) for x in node)
    if not isinstance(node, t.Expr | t.Stmt):
        return node
    if isinstance(node, t.Builtin) and node.name in env.values:
        return env.values[node.name]
    if isinstance(node, t.Scratch):
        if node.name in env.vars:
            return env.vars[node.name]
        return t.Scratch(node.loc, f"{node.name}.{env.suffix}")
    if isinstance(node, t.ForMap):
        arg = env.vars.get(node.var)
        if arg is not None and not isinstance(arg, t.Scratch):
            raise TraceSemanticError(f"${node.var} is a for loop's variable in the macro but "
                                     "given a value that is not a variable", node.loc)
        name = arg.name if isinstance(arg, t.Scratch) else f"{node.var}.{env.suffix}"
        return dataclasses.replace(node, var=name, map=_substitute(node.map, env),
                                   body=_substitute(node.body, env))
    if isinstance(node, t.Declare):
        if node.name in env.vars:
            arg = env.vars[node.name]
            if not isinstance(arg, t.Scratch):
                raise TraceSemanticError(f"${node.name} is declared in the macro but given "
                                         "a value that is not a variable", node.loc)
            return dataclasses.replace(node, name=arg.name)
        return dataclasses.replace(node, name=f"{node.name}.{env.suffix}")
    changes: dict[str, Any] = {}
    for f in dataclasses.fields(node):
        if f.name == "loc":
            continue
        v = getattr(node, f.name)
        new = _substitute(v, env)
        if isinstance(node, t.MapRef) and f.name == "name" and v in env.maps:
            new = env.maps[v]
        if new is not v:
            changes[f.name] = new
    if isinstance(node, t.Assign) and isinstance(changes.get("target"), t.Expr) \
            and not isinstance(changes["target"], t.MapRef | t.Scratch):
        raise TraceSemanticError("a macro assigns a parameter given a value that is not a "
                                 "variable or a map", node.loc)
    return dataclasses.replace(node, **changes) if changes else node


def _relocate(e: t.Expr, loc: Loc) -> t.Expr:
    """``e`` with every span replaced by ``loc`` (a macro's expansion is located at
    its name)."""
    import dataclasses

    changes: dict[str, object] = {"loc": loc}
    for f in dataclasses.fields(e):
        v = getattr(e, f.name)
        if isinstance(v, t.Expr):
            changes[f.name] = _relocate(v, loc)
        elif isinstance(v, tuple) and v and all(isinstance(x, t.Expr) for x in v):
            changes[f.name] = tuple(_relocate(x, loc) for x in v)
    return dataclasses.replace(e, **changes)  # type: ignore[arg-type]


def parse(source: str, filename: str = "stdin", params: tuple[str, ...] = (),
          include_dirs: tuple[Path, ...] = ()) -> t.Program:
    """The program in ``source`` (preprocessed: :mod:`ksim.trace.preprocess`), or a
    TraceError located in it.  ``params``: the values of $1, $2, ..."""
    try:
        text, macros = preprocess(source, include_dirs)
        program = Parser(text, filename, macros, params).program()
    except TraceError as exc:
        raise exc.located(source, filename) from None
    return dataclasses.replace(program, source=source, params=params)


__all__ = ["MAX_DEPTH", "MAX_EXPANDED", "MAX_UNROLLED", "Lexer", "Parser", "TraceLimit",
           "check_depth", "parse"]
