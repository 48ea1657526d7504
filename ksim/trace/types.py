"""C types for trace programs: integers, pointers, records, arrays, strings.

A program's types come from three places: C's and bpftrace's base types
(``int``, ``unsigned long``, ``uint64``, ``u32``), the kernel's BTF (``struct
task_struct``, typedefs, enums, function prototypes: :mod:`ksim.btf`), and the
struct definitions the program makes itself (``struct cfs_rq { ... };``).  A
:class:`CType` is what the compiler reasons with; a record's members and a
pointer's target are resolved on demand, so that naming ``struct sock *`` reads
nothing of the kernel's types beyond ``struct sock`` itself.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .errors import Loc, TraceSemanticError

#: bpftrace's and C's integer type names: size in bytes, signed
INTS: dict[str, tuple[int, bool]] = {
    "int8": (1, True), "int16": (2, True), "int32": (4, True), "int64": (8, True),
    "uint8": (1, False), "uint16": (2, False), "uint32": (4, False), "uint64": (8, False),
    "s8": (1, True), "s16": (2, True), "s32": (4, True), "s64": (8, True),
    "u8": (1, False), "u16": (2, False), "u32": (4, False), "u64": (8, False),
    "__s8": (1, True), "__s16": (2, True), "__s32": (4, True), "__s64": (8, True),
    "__u8": (1, False), "__u16": (2, False), "__u32": (4, False), "__u64": (8, False),
    "char": (1, True), "signed char": (1, True), "unsigned char": (1, False),
    "short": (2, True), "short int": (2, True), "signed short": (2, True),
    "unsigned short": (2, False), "unsigned short int": (2, False), "short unsigned int": (2, False),
    "int": (4, True), "signed": (4, True), "signed int": (4, True), "unsigned": (4, False),
    "unsigned int": (4, False), "long": (8, True), "long int": (8, True), "signed long": (8, True),
    "unsigned long": (8, False), "long unsigned int": (8, False), "unsigned long int": (8, False),
    "long long": (8, True), "long long int": (8, True), "unsigned long long": (8, False),
    "long long unsigned int": (8, False), "bool": (1, False), "_Bool": (1, False),
    "size_t": (8, False), "ssize_t": (8, True), "pid_t": (4, True), "uid_t": (4, False),
    "gid_t": (4, False), "loff_t": (8, True), "umode_t": (2, False), "dev_t": (4, False),
}


@dataclass(eq=False)
class CType:
    """One type.  ``kind``: "int", "ptr", "record", "array", "void", "str" (a string
    value of ``size`` bytes), "func"."""

    kind: str
    size: int = 8
    signed: bool = False
    #: the C spelling, for messages and output
    name: str = ""
    #: a pointer's target or an array's element, or how to make it
    _ref: CType | Callable[[], CType] | None = None
    #: an array's element count
    count: int = 0
    #: a record's members by name: (bit offset, bitfield bits or 0, type)
    _members: Callable[[str], tuple[int, int, CType] | None] | None = None
    #: a record's member names in order (for messages)
    member_names: Callable[[], list[str]] | None = None
    #: where it came from ("btf": the kernel's)
    origin: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ref(self) -> CType:
        r = self._ref
        if callable(r):
            self._ref = r = r()
        assert r is not None, self
        return r

    def member(self, name: str) -> tuple[int, int, CType] | None:
        return None if self._members is None else self._members(name)

    @property
    def is_int(self) -> bool:
        return self.kind == "int"

    @property
    def is_pointer(self) -> bool:
        return self.kind == "ptr"

    @property
    def is_record(self) -> bool:
        return self.kind == "record"

    @property
    def is_string_like(self) -> bool:
        """A string, or an array of chars (read as one)."""
        return self.kind == "str" or (self.kind == "array" and self.ref.kind == "int"
                                      and self.ref.size == 1)

    def __repr__(self) -> str:
        return f"CType({self.name or self.kind})"


def integer(size: int = 8, signed: bool = False, name: str = "") -> CType:
    return CType("int", size, signed, name or f"{'' if signed else 'u'}int{size * 8}")


INT64 = integer(8, True)
UINT64 = integer(8, False)
VOID = CType("void", 0, name="void")


def pointer(to: CType | Callable[[], CType], name: str = "") -> CType:
    if not name and isinstance(to, CType):
        name = f"{to.name} *" if not to.name.endswith("*") else f"{to.name}*"
    return CType("ptr", 8, False, name or "void *", to)


def string(size: int) -> CType:
    return CType("str", size, name=f"string[{size}]")


class TypeSystem:
    """The types a program may name: base types, the program's own struct
    definitions, and the kernel's BTF (``btf``: a :class:`ksim.btf.BTF` or None)."""

    def __init__(self, btf: Any = None, load: Callable[[], Any] | None = None) -> None:
        self._btf = btf
        #: gets the kernel's BTF the first time a type needs it (None: it has none)
        self._load = load
        self.records: dict[str, CType] = {}
        self._btf_cache: dict[int, CType] = {}

    @property
    def btf(self) -> Any:
        if self._btf is None and self._load is not None:
            load, self._load = self._load, None
            self._btf = load()
        return self._btf

    # --- names ---------------------------------------------------------------------------
    def named(self, text: str, loc: Loc | None = None) -> CType:
        """A type from its C spelling: ``struct sock *``, ``unsigned long``, ``uint8``,
        ``u64 *``, ``char [16]``."""
        text = " ".join(text.replace("*", " * ").split())
        stars = text.count("*")
        base = text.replace("*", "").strip()
        t = self._base(base, loc)
        for _ in range(stars):
            t = pointer(t)
        return t

    def _base(self, base: str, loc: Loc | None) -> CType:
        base = re.sub(r"\b(const|volatile|restrict)\b", "", base).strip()
        base = " ".join(base.split())
        if base in INTS:
            size, signed = INTS[base]
            return integer(size, signed, base)
        if base == "void":
            return VOID
        if base == "string":
            return string(64)
        m = re.fullmatch(r"(struct|union|enum)\s+([A-Za-z_]\w*)", base)
        if m:
            kind, name = m.groups()
            if kind in ("struct", "union") and name in self.records:
                return self.records[name]
            if kind == "enum":
                return integer(4, False, base)
            t = self._btf_named(name, kind, loc)
            if t is None:
                raise TraceSemanticError(f"Unknown struct/union: '{base}'" + self._no_btf(), loc)
            return t
        if re.fullmatch(r"[A-Za-z_]\w*", base):
            t = self._btf_named(base, None, loc)
            if t is not None:
                return t
        raise TraceSemanticError(f"Unknown type: '{base}'" + self._no_btf(), loc)

    def _no_btf(self) -> str:
        return "" if self.btf is not None else " (the kernel's BTF is not available)"

    def _btf_named(self, name: str, kind: str | None, loc: Loc | None) -> CType | None:
        if self.btf is None:
            return None
        if kind in ("struct", "union"):
            t = self.btf.find(name, kind)
            if t is None:
                t = self.btf.find(name, "union" if kind == "struct" else "struct")
        else:
            t = self.btf.find(name, kind)
        return None if t is None else self.from_btf(t)

    # --- the kernel's types ---------------------------------------------------------------
    def from_btf(self, t: Any) -> CType:
        """The CType of a BTF type (a :class:`ksim.btf.Type`)."""
        cached = self._btf_cache.get(t.id)
        if cached is not None:
            return cached
        out = self._convert(t)
        self._btf_cache[t.id] = out
        return out

    def _convert(self, t: Any) -> CType:
        btf = self.btf
        kind = t.kind
        if t.id == 0 or kind == "void":
            return VOID
        if kind in ("typedef", "const", "volatile", "restrict", "type_tag"):
            inner = self.from_btf(btf.type(t.ref)) if t.ref else VOID
            if kind == "typedef" and inner.kind == "int":
                return integer(inner.size, inner.signed, t.name)
            return inner
        if kind == "int":
            return integer(t.size, bool(t.signed), t.name)
        if kind == "enum" or kind == "enum64":
            return integer(t.size, bool(t.signed), f"enum {t.name}")
        if kind == "float":
            return CType("int", t.size, True, t.name, origin="float")
        if kind == "ptr":
            target = btf.type(t.ref) if t.ref else None
            name = (btf.describe(t) if target is not None else "void *")
            return CType("ptr", 8, False, name,
                         (lambda: self.from_btf(target)) if target is not None else VOID,
                         origin="btf")
        if kind == "array":
            elem = btf.type(t.elem)
            et = self.from_btf(elem)
            return CType("array", et.size * t.nelems if et.kind != "void" else 0, False,
                         btf.describe(t), et, t.nelems, origin="btf")
        if kind in ("struct", "union"):
            prefix = "struct" if kind == "struct" else "union"
            size = t.size or 0

            def member(name: str, t: Any = t) -> tuple[int, int, CType] | None:
                try:
                    m = btf.member(t, name)
                except Exception:   # the reader's own error: no such member
                    return None
                return m.bit_offset, m.bitfield_size, self.from_btf(m.type)

            def names(t: Any = t) -> list[str]:
                return [m.name for m in btf.members(t)]

            return CType("record", size, False, f"{prefix} {t.name}" if t.name else prefix,
                         _members=member, member_names=names, origin="btf")
        if kind == "fwd":
            full = btf.find(t.name, "struct") or btf.find(t.name, "union")
            if full is not None and full.kind != "fwd":
                return self.from_btf(full)
            return CType("record", 0, False, f"struct {t.name}", origin="btf")
        if kind in ("func", "func_proto"):
            return CType("func", 0, False, t.name)
        return CType("int", t.size or 8, False, t.name or kind)

    def func(self, name: str) -> tuple[list[tuple[str, CType]], CType | None] | None:
        """A kernel function's parameters and return type, from BTF (None: unknown)."""
        if self.btf is None:
            return None
        proto = self.btf.func(name)
        if proto is None:
            return None
        params = [(pname, self.from_btf(pt)) for pname, pt in proto.params]
        ret = None if proto.ret is None else self.from_btf(proto.ret)
        return params, ret

    def enumerator(self, name: str) -> int | None:
        return None if self.btf is None else self.btf.enumerator(name)

    # --- the program's own records ------------------------------------------------------
    def define(self, kind: str, name: str, fields: list[tuple[str, str, int | None]],
               loc: Loc | None = None) -> CType:
        """``struct NAME { TYPE NAME[; ...] };``: laid out as C lays it out (each
        member at its type's alignment; a union's members all at 0)."""
        offset, align, layout = 0, 1, {}
        order = []
        for type_text, fname, count in fields:
            ft = self.named(type_text, loc)
            if count is not None:
                ft = CType("array", ft.size * count, False, f"{ft.name}[{count}]", ft, count)
            a = _alignment(ft)
            align = max(align, a)
            at = 0 if kind == "union" else -(-offset // a) * a
            layout[fname] = (at * 8, 0, ft)
            order.append(fname)
            offset = max(offset, at + ft.size) if kind == "union" else at + ft.size
        size = -(-offset // align) * align
        t = CType("record", size, False, f"{kind} {name}",
                  _members=lambda n: layout.get(n), member_names=lambda: list(order),
                  origin="program")
        self.records[name] = t
        return t

    def sizeof(self, t: CType) -> int:
        return t.size


def _alignment(t: CType) -> int:
    if t.kind in ("int", "ptr"):
        return max(1, t.size)
    if t.kind == "array":
        return _alignment(t.ref)
    if t.kind == "record":
        return min(8, max(1, t.size & -t.size)) if t.size else 1
    return 1


__all__ = ["CType", "INT64", "INTS", "TypeSystem", "UINT64", "VOID", "integer", "pointer", "string"]
