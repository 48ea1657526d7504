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

import re
from dataclasses import dataclass

from . import syntax as t
from .errors import Loc, TraceError, TraceSemanticError, TraceSyntaxError, TraceUnsupported
from .maps import MAX_MAP_KEYS

#: multi-character punctuation, longest first
PUNCT = ("<<=", ">>=", "==", "!=", "<=", ">=", "<<", ">>", "&&", "||", "++", "--", "+=", "-=",
         "*=", "/=", "%=", "&=", "|=", "^=", "->",
         "{", "}", "(", ")", "[", "]", ",", ";", "?", ":", "/", "+", "-", "*", "%", "&", "|",
         "^", "!", "~", "<", ">", "=", ".", "#")
ASSIGN_OPS = ("=", "+=", "-=", "*=", "/=", "%=", "&=", "|=", "^=", "<<=", ">>=")
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
NUMBER = re.compile(r"0[xX][0-9a-fA-F_]+|[0-9][0-9_]*")
#: binary operators by precedence level, loosest first
LEVELS: tuple[tuple[str, ...], ...] = (
    ("||",), ("&&",), ("|",), ("^",), ("&",), ("==", "!="), ("<", "<=", ">", ">="), ("<<", ">>"),
    ("+", "-"), ("*", "/", "%"),
)
#: probe types of bpftrace's language ksim trace does not attach
OTHER_PROVIDERS = {
    "tracepoint": "tracepoint", "t": "tracepoint", "rawtracepoint": "rawtracepoint",
    "rt": "rawtracepoint", "uprobe": "uprobe", "u": "uprobe", "uretprobe": "uretprobe",
    "ur": "uretprobe", "usdt": "usdt", "U": "usdt", "profile": "profile", "p": "profile",
    "software": "software", "s": "software",
    "hardware": "hardware", "h": "hardware", "kfunc": "kfunc", "f": "kfunc", "fentry": "fentry",
    "kretfunc": "kretfunc", "fr": "kretfunc", "fexit": "fexit", "watchpoint": "watchpoint",
    "w": "watchpoint", "asyncwatchpoint": "asyncwatchpoint", "aw": "asyncwatchpoint",
    "iter": "iter", "it": "iter", "self": "self",
}
PROVIDERS = {"kprobe": "kprobe", "k": "kprobe", "kretprobe": "kretprobe", "kr": "kretprobe",
             "interval": "interval", "i": "interval"}
#: units of an interval probe's period, in nanoseconds
INTERVAL_UNITS = {"s": 10**9, "ms": 10**6, "us": 10**3}
#: statement keywords of the full language that the subset lacks
UNSUPPORTED_KEYWORDS = {
    "while": "while loops", "for": "for loops", "unroll": "unroll", "return": "return",
    "let": "variable declarations (let)", "break": "break", "continue": "continue",
    "struct": "struct definitions", "union": "union definitions", "enum": "enum definitions",
    "fn": "function definitions", "macro": "macros", "import": "import",
    "sizeof": "sizeof", "offsetof": "offsetof",
}
#: names that start a cast in the full language: "(uint8)x"
TYPE_NAMES = frozenset({
    "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "bool", "char",
    "short", "int", "long", "unsigned", "signed", "void", "string", "inet", "buffer",
})
#: what follows the "(" of a cast: a struct, union or enum type, or type names, then
#: pointer stars, then ")" -- ``(struct path *)``, ``(uint8)``, ``(unsigned long *)``
_TYPE = "(?:" + "|".join(sorted(TYPE_NAMES)) + r")\b"
CAST = re.compile(r"(?:(?:struct|union|enum)\s+[A-Za-z_]\w*|" + _TYPE + r"(?:\s+" + _TYPE + r")*)"
                  r"\s*(?:\*\s*)*\)")
#: settings of a config block: each of bpftrace's names for one ksim knows
CONFIG_NAMES = {"max_map_keys": "max_map_keys", "BPFTRACE_MAX_MAP_KEYS": "max_map_keys"}
#: settings bpftrace's config block has that ksim trace does not
OTHER_CONFIG = frozenset({
    "cache_user_symbols", "cpp_demangle", "lazy_symbolication", "license", "log_size",
    "max_ast_nodes", "max_bpf_progs", "max_cat_bytes", "max_probes", "max_strlen",
    "max_type_res_iterations", "missing_probes", "on_stack_limit", "perf_rb_pages",
    "print_maps_on_exit", "show_debug_info", "stack_mode", "str_trunc_trailer",
    "symbol_source", "use_blazesym", "unstable_import", "unstable_macro", "unstable_map_decl",
    "unstable_tseries", "unstable_addr",
})


@dataclass(frozen=True, slots=True)
class Token:
    kind: str          # "int", "str", "name", "var", "map", "punct", "eof"
    text: str
    loc: Loc
    value: int | str | None = None


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
        if c.isdigit():
            m = NUMBER.match(self.src, self.pos)
            assert m is not None
            text = m.group(0)
            self._advance(len(text))
            if self.pos < len(self.src) and (self.src[self.pos].isalnum() or self.src[self.pos] == "_"):
                raise TraceSyntaxError(f"invalid integer literal {text + self.src[self.pos]!r}",
                                       self.loc(start, self.pos + 1, line, line_start))
            kind, value = "int", int(text.replace("_", ""), 0)
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
    def __init__(self, source: str, filename: str = "stdin") -> None:
        self.source = source
        self.filename = filename
        self.lex = Lexer(source)
        self.tok = self.lex.next()
        self.peeked: Token | None = None
        self.in_filter = False

    # --- tokens -------------------------------------------------------------------------
    def advance(self) -> Token:
        tok = self.tok
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
        config: dict[str, int] = {}
        if self.at("config") and self.peek().text == "=":
            config = self.config()
        probes = []
        while self.tok.kind != "eof":
            probes.append(self.probe())
        return t.Program(tuple(probes), self.source, self.filename, config)

    def config(self) -> dict[str, int]:
        """``config = { max_map_keys = 10000; ... }`` (bpftrace's config block: first in
        the program; a setting by its own name or its environment variable's)."""
        self.advance()
        self.expect("=")
        self.expect("{", "'{' opening the config block")
        out: dict[str, int] = {}
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
            short = tok.text.lower().removeprefix("bpftrace_")
            if tok.text not in CONFIG_NAMES:
                if short in OTHER_CONFIG or short in CONFIG_NAMES:
                    raise TraceUnsupported(f"config setting {tok.text} is not supported (only "
                                           "max_map_keys)", tok.loc)
                raise TraceSemanticError(f"Unrecognized config variable: {tok.text}", tok.loc)
            if value.kind != "int" or not 0 < int(value.value or 0) <= MAX_MAP_KEYS:
                raise TraceSemanticError(f"{tok.text} must be an integer from 1 to {MAX_MAP_KEYS}",
                                         value.loc)
            out[CONFIG_NAMES[tok.text]] = int(value.value or 0)
            if not self.at("}"):
                self.expect(";", "';' or '}'")
        self.advance()
        return out

    def probe(self) -> t.Probe:
        if self.at("#"):
            raise TraceUnsupported("preprocessor directives (#include, #define) are not supported",
                                   self.tok.loc)
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
        return t.Probe(tuple(points), pred, body, start)

    def _offset(self, loc: Loc) -> int:
        """The source offset of ``loc``'s start."""
        lines = self.source.split("\n")
        return sum(len(x) + 1 for x in lines[:loc.line - 1]) + loc.col - 1

    def attach_point(self, tok: Token) -> t.AttachPoint:
        text, loc = tok.text, tok.loc
        if not text:
            raise TraceSyntaxError("syntax error, expecting an attach point", loc)
        if text in ("BEGIN", "END"):
            return t.AttachPoint(text, text=text, loc=loc)
        provider, colon, rest = text.partition(":")
        if not colon:
            raise TraceSyntaxError(f"invalid attach point {text!r}: expecting PROVIDER:FUNCTION, "
                                   "BEGIN or END", loc)
        if provider in OTHER_PROVIDERS:
            raise TraceUnsupported(f"{OTHER_PROVIDERS[provider]} probes are not supported "
                                   "(only kprobe, kretprobe, interval, BEGIN and END)", loc)
        if provider not in PROVIDERS:
            raise TraceSyntaxError(f"Invalid probe type: {provider}", loc)
        kind = PROVIDERS[provider]
        if kind == "interval":
            unit, colon, count = rest.partition(":")
            if not colon or unit not in INTERVAL_UNITS or not count.isdigit() or int(count) == 0:
                raise TraceSyntaxError(f"invalid interval probe {text!r}: expecting interval:s:N, "
                                       "interval:ms:N or interval:us:N (N > 0)", loc)
            return t.AttachPoint(kind, text=text, loc=loc,
                                 period_ns=int(count) * INTERVAL_UNITS[unit])
        if ":" in rest:
            raise TraceUnsupported(f"{kind} with a module (MODULE:FUNCTION) is not supported", loc)
        func, plus, offset_text = rest.partition("+")
        if not func or not re.fullmatch(r"[A-Za-z0-9_.*?\[\]!-]+", func):
            raise TraceSyntaxError(f"invalid function name {func!r} in {text!r}", loc)
        offset = None
        if plus:
            if kind == "kretprobe":
                raise TraceSemanticError("Offset not allowed for kretprobe", loc)
            if any(c in func for c in "*?["):
                raise TraceSemanticError("Offset not allowed with a wildcard", loc)
            try:
                offset = int(offset_text, 0)
            except ValueError:
                raise TraceSyntaxError(f"invalid offset {offset_text!r}", loc) from None
        return t.AttachPoint(kind, func, offset, text, loc)

    # --- statements ------------------------------------------------------------------------
    def block(self) -> tuple[t.Stmt, ...]:
        self.expect("{")
        stmts: list[t.Stmt] = []
        while not self.at("}"):
            if self.tok.kind == "eof":
                self.fail("expecting '}'")
            if self.at(";"):
                self.advance()
                continue
            stmt = self.statement()
            stmts.append(stmt)
            if isinstance(stmt, t.If) or self.at("}"):
                continue
            self.expect(";", "';' or '}'")
        self.advance()
        return tuple(stmts)

    def statement(self) -> t.Stmt:
        tok = self.tok
        if tok.kind == "name" and tok.text in UNSUPPORTED_KEYWORDS:
            raise TraceUnsupported(f"{UNSUPPORTED_KEYWORDS[tok.text]} are not supported", tok.loc)
        if tok.kind == "name" and tok.text == "if":
            return self.if_statement()
        if self.at("{"):
            raise TraceUnsupported("nested blocks are not supported (use if)", tok.loc)
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
        self.expect("(", "'(' after if")
        cond = self.expr()
        self.expect(")", "')' closing the condition")
        then = self.block()
        orelse: tuple[t.Stmt, ...] = ()
        if self.at("else"):
            self.advance()
            if self.at("if"):
                orelse = (self.if_statement(),)
            else:
                orelse = self.block()
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
        return self.ternary(self.binary(0))

    def ternary(self, cond: t.Expr) -> t.Expr:
        if not self.at("?"):
            return cond
        self.advance()
        then = self.expr()
        self.expect(":", "':' of the conditional expression")
        orelse = self.expr()
        return t.Ternary(cond.loc.to(orelse.loc), cond, then, orelse)

    def binary(self, level: int, first: t.Expr | None = None) -> t.Expr:
        if level == len(LEVELS):
            return first if first is not None else self.unary()
        left = self.binary(level + 1, first)
        while self.tok.kind == "punct" and self.tok.text in LEVELS[level]:
            if self.in_filter and self.at("/") and self.peek().text == "{":
                break       # the '/' closing a filter, not a division
            op = self.advance().text
            right = self.binary(level + 1)
            left = t.Binary(left.loc.to(right.loc), op, left, right)
        return left

    def unary(self) -> t.Expr:
        tok = self.tok
        if self.at("!", "~", "-", "+"):
            self.advance()
            operand = self.unary()
            return t.Unary(tok.loc.to(operand.loc), tok.text, operand)
        if self.at("*"):
            raise TraceUnsupported("pointer dereference (*expr) is not supported", tok.loc)
        if self.at("&"):
            raise TraceUnsupported("taking an address (&expr) is not supported", tok.loc)
        if self.at("++", "--"):
            raise TraceUnsupported(f"{tok.text} inside an expression is not supported "
                                   "(use it as a statement)", tok.loc)
        return self.postfix(self.primary())

    def postfix(self, expr: t.Expr) -> t.Expr:
        if self.at(".", "->"):
            raise TraceUnsupported(f"field access ({self.tok.text}) is not supported", self.tok.loc)
        if self.at("["):
            raise TraceUnsupported("indexing anything but a map is not supported", self.tok.loc)
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
            self.scratch_name(tok)
            return t.Scratch(tok.loc, str(tok.value))
        if tok.kind == "map":
            return self.map_ref()
        if self.at("("):
            self.advance()
            if self.tok.kind == "name":
                self.refuse_cast(tok)
            inner = self.expr()
            if self.at(","):
                raise TraceUnsupported("tuples are not supported", self.tok.loc)
            self.expect(")", "')'")
            return inner
        if tok.kind == "name":
            if tok.text in UNSUPPORTED_KEYWORDS:
                raise TraceUnsupported(f"{UNSUPPORTED_KEYWORDS[tok.text]} are not supported", tok.loc)
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
                return t.Call(tok.loc.to(end), tok.text, tuple(args), tok.loc)
            return t.Builtin(tok.loc, tok.text)
        self.fail("expecting an expression")
        raise AssertionError


    def refuse_cast(self, paren: Token) -> None:
        """A cast, ``(struct path *)x``, is refused as one (not as the struct
        definition its keyword would otherwise start), its span underlined."""
        at = self._offset(self.tok.loc)
        m = CAST.match(self.source, at)
        if m is None:
            return
        start = self._offset(paren.loc)
        text = " ".join(self.source[start:m.end()].split())
        raise TraceUnsupported(f"casts are not supported: {text}",
                               Loc(paren.loc.line, paren.loc.col, paren.loc.col + m.end() - start))


def parse(source: str, filename: str = "stdin") -> t.Program:
    """The program in ``source``, or a TraceError located in it."""
    try:
        return Parser(source, filename).program()
    except TraceError as exc:
        raise exc.located(source, filename) from None


__all__ = ["Lexer", "Parser", "parse"]
