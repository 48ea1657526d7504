"""A reader of BTF, the BPF Type Format (Linux Documentation/bpf/btf.rst).

A BTF blob is a header, a type section and a string section.  Types are numbered
from 1 in the order they appear (0 is void); each is a 12-byte ``struct btf_type``
(name offset, info, size or type) followed by data of its kind (an INT's encoding,
an ARRAY's element, a STRUCT's members, ...).  *Split* BTF (a module's, in
``/sys/kernel/btf/<module>`` or a ``.ko``'s ``.BTF``) continues a base BTF
(vmlinux's): its first type id is the one after the base's last, and its string
offsets start at the base's string section's length (libbpf's btf__new_split).

Loading walks the type section once, recording where each type starts and its name
and kind (a Debian vmlinux's 100 k types in some 100 ms); a type is decoded into a
:class:`Type` when it is first asked for, and names are indexed when a name is first
looked up.  Whatever is malformed -- a header, a truncated record, an unknown kind, a
type id or a string offset out of range, a chain of typedefs that loops -- raises
:class:`BTFError` naming the place, when it is reached; :meth:`BTF.validate` reaches
everything at once.

Pure: bytes in, types out.  Where the bytes come from is :mod:`ksim.btf.sources`.
"""

from __future__ import annotations

import os
import struct
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

from ksim.btf.errors import BTFError

MAGIC = 0xEB9F
HEADER_SIZE = 24  # struct btf_header: magic, version, flags, hdr_len, 4 x u32
TYPE_SIZE = 12    # struct btf_type: name_off, info, size/type

#: BTF_KIND_* by number (include/uapi/linux/btf.h); 0 (UNKN) is not a kind a type has
KINDS = ("", "int", "ptr", "array", "struct", "union", "enum", "fwd", "typedef", "volatile",
         "const", "restrict", "func", "func_proto", "var", "datasec", "float", "decl_tag",
         "type_tag", "enum64")
KIND_NUMBER = {name: i for i, name in enumerate(KINDS) if name}
#: bytes after struct btf_type: fixed, and per vlen item (btf.rst, "Type Encoding")
_FIXED = (0, 4, 0, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 4, 0, 0, 4, 0, 0)
_PER_ITEM = (0, 0, 0, 0, 12, 12, 8, 0, 0, 0, 0, 0, 0, 8, 0, 12, 0, 0, 0, 12)
#: kinds whose third word is a size (the others' is a type id, or unused: ARRAY, FWD)
_SIZED = frozenset({"int", "struct", "union", "enum", "datasec", "float", "enum64"})
_REFERS = frozenset({"ptr", "typedef", "volatile", "const", "restrict", "func", "func_proto",
                     "var", "decl_tag", "type_tag"})
#: what strip() goes through
_TRANSPARENT = frozenset({"typedef", "const", "volatile", "restrict", "type_tag"})
_QUALIFIERS = frozenset({"const", "volatile", "restrict"})
_RECORDS = frozenset({"struct", "union"})
_LINKAGE = ("static", "global", "extern")
#: BTF_INT_ENCODING bits
_INT_SIGNED, _INT_CHAR, _INT_BOOL = 1, 2, 4
#: how far a chain of types is followed before it is taken for a loop (libbpf's
#: MAX_RESOLVE_DEPTH is 32; a declarator nests deeper: pointers to arrays of ...)
MAX_DEPTH = 64
#: how many types one question visits at most (a prototype's parameters, anonymous
#: members: a malformed blob could make them branch out exponentially)
MAX_STEPS = 1 << 14
#: find(kind=None): which kind a name means when several kinds share it
_PREFERENCE = ("struct", "union", "typedef", "enum", "enum64", "int", "float", "func", "var",
               "datasec", "fwd")


class Field(NamedTuple):
    """A struct or union member as its record says: bit offset from the start of the
    record, and bitfield size (0: not a bitfield, or the legacy encoding, where the
    member's INT type holds it; see BTF.members)."""

    name: str
    type_id: int
    bit_offset: int
    bitfield_size: int


@dataclass(frozen=True, slots=True, repr=False)
class Type:
    """One BTF type.  ``ref`` is the type it refers to: the pointee of a ptr, the type
    of a typedef, qualifier, type_tag, var or decl_tag, the prototype of a func, the
    return type of a func_proto (0: void), the element type of an array."""

    id: int
    kind: str
    name: str = ""
    size: int | None = None
    ref: int | None = None
    kind_flag: bool = False
    #: int, enum, enum64: values are signed
    signed: bool = False
    #: int: BTF_INT_BITS (value bits) and BTF_INT_OFFSET; char and bool encodings
    bits: int = 0
    int_offset: int = 0
    is_char: bool = False
    is_bool: bool = False
    #: array: element count and index type
    nelems: int = 0
    index_type: int = 0
    #: struct, union: the members as the record has them
    fields: tuple[Field, ...] = ()
    #: enum, enum64: (name, value)
    values: tuple[tuple[str, int], ...] = ()
    #: func_proto: (name, type id); a variadic prototype ends with ("", 0)
    params: tuple[tuple[str, int], ...] = ()
    #: func, var: "static", "global" or "extern"
    linkage: str = ""
    #: fwd: "struct" or "union"
    fwd_kind: str = ""
    #: datasec: (var type id, offset, size)
    entries: tuple[tuple[int, int, int], ...] = ()
    #: decl_tag: the member or parameter tagged, -1 for the whole type
    component: int = -1

    @property
    def elem(self) -> int:
        """An array's element type id."""
        if self.kind != "array":
            raise BTFError(f"type {self.id} is {self.kind}, not an array")
        assert self.ref is not None
        return self.ref

    def __repr__(self) -> str:
        size = f" size={self.size}" if self.size is not None else ""
        ref = f" ref={self.ref}" if self.ref is not None else ""
        return f"<Type {self.id} {self.kind} {self.name or '(anon)'}{size}{ref}>"


VOID = Type(0, "void")


@dataclass(frozen=True, slots=True)
class Member:
    """A member of a struct or union, found by name: its offset in bits from the start
    of the record asked about (through anonymous members), and its bitfield size (0
    when it is not a bitfield)."""

    name: str
    type: Type
    bit_offset: int
    bitfield_size: int

    @property
    def offset(self) -> int:
        """Byte offset (of the byte holding the first bit, for a bitfield)."""
        return self.bit_offset // 8


@dataclass(frozen=True, slots=True)
class FuncProto:
    """A kernel function's prototype: its parameters' names and types, and its return
    type (None: void)."""

    name: str
    params: tuple[tuple[str, Type], ...]
    ret: Type | None
    variadic: bool = False


class BTF:
    """The types of one BTF blob (and, for split BTF, of its base)."""

    #: one past the last type id (of this blob; a split blob's start where its base's end)
    nr_types: int
    _end_str: int

    def __init__(self, data: bytes, base: BTF | None, name: str) -> None:
        self.name = name
        self.base = base
        self._data = bytes(data)
        self._endian, types, strings = _sections(self._data, name, split=base is not None)
        self._strings = strings
        self.start_id = base.nr_types if base is not None else 1
        self.start_str = base._end_str if base is not None else 0
        self._end_str = self.start_str + len(strings)
        self._types = types
        self._offsets, self._names, self._infos = _walk(types, self._endian, self.start_id, name)
        self.nr_types = self.start_id + len(self._offsets)
        self._cache: dict[int, Type] = {}
        self._strcache: dict[int, str] = {}
        self._by_name: dict[str, list[int]] | None = None
        self._enumerators: dict[str, int] | None = None
        self._ptr_size: int | None = None
        self._unpack3 = struct.Struct(self._endian + "III").unpack_from

    def __repr__(self) -> str:
        base = f" on {self.base.name}" if self.base is not None else ""
        return f"<BTF {self.name}{base}: types {self.start_id}..{self.nr_types - 1}>"

    # --- loading ------------------------------------------------------------------
    @classmethod
    def from_bytes(cls, data: bytes, base: BTF | None = None, name: str = "vmlinux") -> BTF:
        """The BTF in ``data`` (split BTF on top of ``base`` when given)."""
        return cls(data, base, name)

    @classmethod
    def from_elf(cls, path_or_bytes: str | os.PathLike[str] | bytes, base: BTF | None = None,
                 name: str | None = None) -> BTF:
        """The ``.BTF`` section of an ELF file (a path) or image (bytes): a vmlinux, or
        a module's ``.ko`` with ``base`` its kernel's BTF."""
        from ksim.btf.elf import btf_section, elf_name

        data = btf_section(path_or_bytes)
        return cls(data, base, name or elf_name(path_or_bytes, module=base is not None))

    @property
    def pointer_size(self) -> int:
        """BTF does not say how wide a pointer is: like libbpf (determine_ptr_size), the
        size of ``long`` answers, and 8 when the BTF has no ``long``."""
        if self._ptr_size is None:
            if self.base is not None:
                self._ptr_size = self.base.pointer_size
            else:
                self._ptr_size = 8
                for name in ("long int", "long unsigned int", "unsigned long", "long"):
                    t = self.find(name, "int")
                    if t is not None and t.size in (4, 8):
                        self._ptr_size = t.size
                        break
        return self._ptr_size

    # --- types --------------------------------------------------------------------
    def type(self, type_id: int) -> Type:
        """The type numbered ``type_id`` (0: void)."""
        if type_id < self.start_id:
            if type_id == 0:
                return VOID
            if self.base is not None and type_id > 0:
                return self.base.type(type_id)
        t = self._cache.get(type_id)
        if t is None:
            i = type_id - self.start_id
            if not 0 <= i < len(self._offsets):
                raise BTFError(f"type id {type_id} is out of range: {self._range()}")
            t = self._cache[type_id] = self._decode(type_id, self._offsets[i])
        return t

    def types(self) -> Iterator[Type]:
        """This blob's own types in id order (not its base's)."""
        for type_id in range(self.start_id, self.nr_types):
            yield self.type(type_id)

    def _range(self) -> str:
        base = f" (on {self.base.name}'s 1..{self.start_id - 1})" if self.base is not None else ""
        return f"{self.name}'s BTF has types {self.start_id}..{self.nr_types - 1}{base}"

    def _string(self, offset: int, where: str) -> str:
        s = self._strcache.get(offset)
        if s is not None:
            return s
        if offset < self.start_str:
            assert self.base is not None
            return self.base._string(offset, where)
        at = offset - self.start_str
        if at >= len(self._strings):
            raise BTFError(f"{self.name}: {where}: string offset {offset} is past the end of the "
                           f"string section ({self._end_str} bytes)")
        end = self._strings.index(b"\0", at)  # the section ends with a NUL (_sections)
        s = self._strcache[offset] = self._strings[at:end].decode("utf-8", "replace")
        return s

    def _ref(self, ref: int, where: str, what: str) -> int:
        if not 0 <= ref < self.nr_types:
            raise BTFError(f"{self.name}: {where}: {what} is type id {ref}, out of range: "
                           f"{self._range()}")
        return ref

    def _decode(self, type_id: int, at: int) -> Type:
        data, unpack3, e = self._types, self._unpack3, self._endian
        name_off, info, word = unpack3(data, at)
        kind = KINDS[info >> 24 & 0x1F]
        vlen, flag = info & 0xFFFF, bool(info >> 31)
        where = f"type {type_id} ({kind})"
        name = self._string(name_off, where) if name_off else ""
        body = at + TYPE_SIZE
        size = word if kind in _SIZED else None
        ref = self._ref(word, where, "its referenced type") if kind in _REFERS else None

        def make(**more: Any) -> Type:
            return Type(type_id, kind, name, size, ref, flag, **more)

        if kind == "int":
            (enc,) = struct.unpack_from(e + "I", data, body)
            encoding = enc >> 24 & 0xF
            return make(signed=bool(encoding & _INT_SIGNED), is_char=bool(encoding & _INT_CHAR),
                        is_bool=bool(encoding & _INT_BOOL), bits=enc & 0xFF,
                        int_offset=enc >> 16 & 0xFF)
        if kind == "array":
            elem, index, nelems = unpack3(data, body)
            ref = self._ref(elem, where, "its element type")
            return make(index_type=self._ref(index, where, "its index type"), nelems=nelems)
        if kind in _RECORDS:
            fields = []
            for i in range(vlen):
                m_name, m_type, m_off = unpack3(data, body + 12 * i)
                what = f"member {i}"
                fields.append(Field(self._string(m_name, f"{where} {what}") if m_name else "",
                                    self._ref(m_type, where, f"{what}'s type"),
                                    m_off & 0xFFFFFF if flag else m_off, m_off >> 24 if flag else 0))
            return make(fields=tuple(fields))
        if kind == "enum":
            items = struct.unpack_from(e + ("Ii" if flag else "II") * vlen, data, body)
            return make(signed=flag, values=tuple(
                (self._string(items[2 * i], f"{where} value {i}"), items[2 * i + 1])
                for i in range(vlen)))
        if kind == "enum64":
            values = []
            for i in range(vlen):
                v_name, lo, hi = unpack3(data, body + 12 * i)
                value = hi << 32 | lo
                if flag and value >> 63:
                    value -= 1 << 64
                values.append((self._string(v_name, f"{where} value {i}"), value))
            return make(signed=flag, values=tuple(values))
        if kind == "func_proto":
            items = struct.unpack_from(e + "II" * vlen, data, body)
            return make(params=tuple(
                (self._string(items[2 * i], f"{where} parameter {i}") if items[2 * i] else "",
                 self._ref(items[2 * i + 1], where, f"parameter {i}'s type"))
                for i in range(vlen)))
        if kind == "func":
            return make(linkage=_LINKAGE[vlen] if vlen < len(_LINKAGE) else f"linkage {vlen}")
        if kind == "var":
            (linkage,) = struct.unpack_from(e + "I", data, body)
            return make(linkage=_LINKAGE[linkage] if linkage < len(_LINKAGE) else f"linkage {linkage}")
        if kind == "fwd":
            return make(fwd_kind="union" if flag else "struct")
        if kind == "datasec":
            items = struct.unpack_from(e + "III" * vlen, data, body)
            return make(entries=tuple(
                (self._ref(items[3 * i], where, f"entry {i}'s variable"), items[3 * i + 1],
                 items[3 * i + 2]) for i in range(vlen)))
        if kind == "decl_tag":
            (component,) = struct.unpack_from(e + "i", data, body)
            return make(component=component)
        return make()  # ptr, typedef, qualifiers, type_tag, float

    # --- names --------------------------------------------------------------------
    def _index(self) -> dict[str, list[int]]:
        if self._by_name is None:
            by_name: dict[str, list[int]] = {}
            string, start = self._string, self.start_id
            for i, name_off in enumerate(self._names):
                if name_off:
                    name = string(name_off, f"type {start + i}")
                    ids = by_name.get(name)
                    if ids is None:
                        by_name[name] = [start + i]
                    else:
                        ids.append(start + i)
            self._by_name = by_name
        return self._by_name

    def _kind_of(self, type_id: int) -> str:
        if type_id < self.start_id:
            assert self.base is not None
            return self.base._kind_of(type_id)
        return KINDS[self._infos[type_id - self.start_id] >> 24 & 0x1F]

    def _named(self, name: str) -> list[int]:
        """Ids of every type called ``name``: this blob's, then its base's."""
        own = self._index().get(name, [])
        return own + self.base._named(name) if self.base is not None else own

    def find(self, name: str, kind: str | None = None) -> Type | None:
        """The type called ``name`` ("sock", or "struct sock", "union ...", "enum ...")
        of ``kind`` (a kind name; "enum" also finds enum64), or of any kind with
        structs, unions and typedefs first and forward declarations last; None when
        there is none."""
        name, kind = _split_kind(name, kind)
        if kind is not None and kind not in KIND_NUMBER:
            raise BTFError(f"unknown BTF kind {kind!r}; kinds: {', '.join(KINDS[1:])}")
        ids = self._named(name)
        if kind is not None:
            wanted = {"enum", "enum64"} if kind == "enum" else {kind}
            for type_id in ids:
                if self._kind_of(type_id) in wanted:
                    return self.type(type_id)
            return None
        best: tuple[int, int] | None = None
        for type_id in ids:
            kind_of = self._kind_of(type_id)
            rank = _PREFERENCE.index(kind_of) if kind_of in _PREFERENCE else len(_PREFERENCE)
            if best is None or rank < best[0]:
                best = (rank, type_id)
        return self.type(best[1]) if best is not None else None

    def struct(self, name: str) -> Type:
        """The struct or union called ``name`` ("sock", "struct sock", "union ...")."""
        bare, kind = _split_kind(name, None)
        if kind not in (None, "struct", "union"):
            raise BTFError(f"{name!r} is not a struct or union name")
        for type_id in self._named(bare):
            k = self._kind_of(type_id)
            if k in _RECORDS and kind in (None, k):
                return self.type(type_id)
        spelled = f"{kind or 'struct'} {bare}"
        if any(self._kind_of(i) == "fwd" for i in self._named(bare)):
            raise BTFError(f"{spelled} is only declared (a forward declaration) in "
                           f"{self._owner()} BTF, not defined")
        raise BTFError(f"no {spelled} in {self._owner()} BTF")

    def _owner(self) -> str:
        return "the kernel's" if self.name == "vmlinux" else f"{self.name}'s"

    def func(self, name: str) -> FuncProto | None:
        """The prototype of the function called ``name`` (a FUNC), or None."""
        func = self.find(name, "func")
        if func is None:
            return None
        assert func.ref is not None
        proto = self.type(func.ref)
        if proto.kind != "func_proto":
            raise BTFError(f"{self.name}: func {name!r} (type {func.id}) refers to type {proto.id}, "
                           f"a {proto.kind}, not a func_proto")
        params = list(proto.params)
        variadic = bool(params) and params[-1] == ("", 0)
        if variadic:
            params.pop()
        return FuncProto(name, tuple((p, self.type(t)) for p, t in params),
                         None if not proto.ref else self.type(proto.ref), variadic)

    def enumerator(self, name: str) -> int | None:
        """The value of the enum constant ``name``, from whichever enum defines it."""
        if self._enumerators is None:
            table: dict[str, int] = {}
            enum, enum64 = KIND_NUMBER["enum"], KIND_NUMBER["enum64"]
            for i, info in enumerate(self._infos):
                if info >> 24 & 0x1F in (enum, enum64):
                    for value_name, value in self.type(self.start_id + i).values:
                        table.setdefault(value_name, value)
            self._enumerators = table
        found = self._enumerators.get(name)
        if found is None and self.base is not None:
            return self.base.enumerator(name)
        return found

    # --- layout -------------------------------------------------------------------
    def strip(self, t: Type) -> Type:
        """``t`` through typedefs, qualifiers and type tags."""
        seen: list[int] = []
        while t.kind in _TRANSPARENT:
            seen.append(t.id)
            if len(seen) > MAX_DEPTH:
                raise BTFError(f"{self.name}: type {seen[0]}: its chain of typedefs and "
                               f"qualifiers loops ({' -> '.join(map(str, seen[:8]))} ...)")
            assert t.ref is not None
            t = self.type(t.ref)
            if t.id in seen:
                raise BTFError(f"{self.name}: type {seen[0]}: its chain of typedefs and qualifiers "
                               f"loops back to type {t.id}")
        return t

    def sizeof(self, t: Type) -> int:
        """The size in bytes of a value of type ``t``."""
        return self._sizeof(t, t, 0)

    def _sizeof(self, t: Type, asked: Type, depth: int) -> int:
        if depth > MAX_DEPTH:
            raise BTFError(f"{self.name}: the size of type {asked.id} needs a chain of more than "
                           f"{MAX_DEPTH} types (a loop?)")
        t = self.strip(t)
        if t.size is not None:  # int, float, enum, enum64, struct, union, datasec
            return t.size
        if t.kind == "ptr":
            return self.pointer_size
        if t.kind == "array":
            assert t.ref is not None
            return t.nelems * self._sizeof(self.type(t.ref), asked, depth + 1)
        if t.kind == "var":
            assert t.ref is not None
            return self._sizeof(self.type(t.ref), asked, depth + 1)
        what = {"void": "void has no size", "fwd": f"{t.fwd_kind} {t.name} is only declared",
                "func": f"{t.name} is a function", "func_proto": "a function type has no size"}
        raise BTFError(f"no sizeof {self.describe(asked)}: {what.get(t.kind, t.kind + ' has no size')}")

    def members(self, t: Type) -> list[Member]:
        """The members of the struct or union ``t`` (through typedefs): the named ones,
        and those of anonymous members in their place, offsets from the start of ``t``."""
        record = self._record(t, "members of")
        out: list[Member] = []
        self._flatten(record, 0, out, [record.id], [0])
        return out

    def _flatten(self, record: Type, base: int, out: list[Member], path: list[int],
                 steps: list[int]) -> None:
        for f in record.fields:
            m = self._member(record, f, base)
            if f.name:
                out.append(m)
                continue
            inner = self.strip(m.type)
            if inner.kind not in _RECORDS:
                continue  # an unnamed bitfield: padding
            self._nest(record, inner, path, steps)
            self._flatten(inner, m.bit_offset, out, [*path, inner.id], steps)

    def _member(self, record: Type, f: Field, base: int) -> Member:
        mtype = self.type(f.type_id)
        offset, bits = f.bit_offset, f.bitfield_size
        if not record.kind_flag and mtype.kind == "int" and mtype.size is not None and (
                mtype.int_offset or mtype.bits != 8 * mtype.size):
            # the legacy encoding (btf.rst, "BTF_KIND_STRUCT"): the member's INT type
            # holds the bitfield's size and its offset past the member's
            offset, bits = offset + mtype.int_offset, mtype.bits
        return Member(f.name, mtype, base + offset, bits)

    def member(self, t: Type, name: str) -> Member:
        """The member ``name`` of struct or union ``t``, looked for through anonymous
        members too; ``a.b.c`` goes through embedded structs and unions.  Its offset
        is from the start of ``t``."""
        offset, found = 0, None
        record = t
        for part in name.split("."):
            rec = self._record(record, f"member {name!r} of")
            found = self._find_member(rec, part, 0, [rec.id], [0])
            if found is None:
                raise BTFError(f"{self.describe(rec)} has no member {part!r}"
                               + (f" (looking for {name!r} in {self.describe(t)})" if part != name else ""))
            offset += found.bit_offset
            record = found.type
        assert found is not None
        return Member(found.name, found.type, offset, found.bitfield_size)

    def _find_member(self, record: Type, name: str, base: int, path: list[int],
                     steps: list[int]) -> Member | None:
        for f in record.fields:
            if f.name == name:
                return self._member(record, f, base)
        for f in record.fields:  # then inside anonymous ones, in order
            if f.name:
                continue
            m = self._member(record, f, base)
            inner = self.strip(m.type)
            if inner.kind not in _RECORDS:
                continue
            self._nest(record, inner, path, steps)
            found = self._find_member(inner, name, m.bit_offset, [*path, inner.id], steps)
            if found is not None:
                return found
        return None

    def _nest(self, record: Type, inner: Type, path: list[int], steps: list[int]) -> None:
        """Check one step into an anonymous member: no record inside itself, and no
        more than MAX_STEPS records looked into (nested anonymous members branch out)."""
        steps[0] += 1
        if inner.id in path or len(path) > MAX_DEPTH or steps[0] > MAX_STEPS:
            raise BTFError(f"{self.name}: type {path[0]} contains itself through anonymous "
                           f"members, or nests them too deep (types "
                           f"{' -> '.join(map(str, [*path[:8], inner.id]))})")

    def _record(self, t: Type, what: str) -> Type:
        record = self.strip(t)
        if record.kind in _RECORDS:
            return record
        if record.kind == "fwd":
            raise BTFError(f"no {what} {self.describe(t)}: it is only declared, not defined, "
                           f"in {self._owner()} BTF")
        raise BTFError(f"no {what} {self.describe(t)}: not a struct or union")

    # --- predicates -----------------------------------------------------------------
    def is_pointer(self, t: Type) -> bool:
        return self.strip(t).kind == "ptr"

    def is_array(self, t: Type) -> bool:
        return self.strip(t).kind == "array"

    def is_record(self, t: Type) -> bool:
        """A struct or union (through typedefs)."""
        return self.strip(t).kind in _RECORDS

    def is_integer(self, t: Type) -> tuple[int, bool] | None:
        """(size, signed) of an integer type (int, char, bool, enum), else None."""
        s = self.strip(t)
        if s.kind in ("int", "enum", "enum64") and s.size is not None:
            return s.size, s.signed
        return None

    # --- spelling -------------------------------------------------------------------
    def describe(self, t: Type) -> str:
        """``t`` as C spells a type: "struct sock *", "char [16]", "unsigned int",
        "u64", "int (*)(struct file *, char *)"."""
        return self._declare(t, "", 0, [0])

    def _declare(self, t: Type, inner: str, depth: int, steps: list[int]) -> str:
        """C's declarator of ``inner`` (what is declared so far, innermost first) as
        ``t``; ``steps`` counts the types visited (prototypes branch out)."""
        steps[0] += 1
        if depth > MAX_DEPTH or steps[0] > MAX_STEPS:
            raise BTFError(f"{self.name}: type {t.id}: spelling it needs a chain of more than "
                           f"{MAX_DEPTH} types or more than {MAX_STEPS} in all (a loop?)")

        def sp(s: str) -> str:
            return f" {s}" if s else ""

        kind = t.kind
        if kind == "void":
            return "void" + sp(inner)
        if kind in ("int", "float", "typedef"):
            return t.name + sp(inner)
        if kind in ("struct", "union", "enum"):
            return f"{kind} {t.name or '(anon)'}" + sp(inner)
        if kind == "enum64":
            return f"enum {t.name or '(anon)'}" + sp(inner)
        if kind == "fwd":
            return f"{t.fwd_kind} {t.name}" + sp(inner)
        if kind == "datasec":
            return f"datasec {t.name}"
        assert t.ref is not None
        ref = self.type(t.ref)
        if kind == "ptr":
            target = self._unqualified(ref)
            inner = f"(*{inner})" if target.kind in ("array", "func_proto") else f"*{inner}"
            return self._declare(ref, inner, depth + 1, steps)
        if kind in _QUALIFIERS:
            if self._unqualified(ref).kind == "ptr":  # char *const p
                return self._declare(ref, kind + sp(inner), depth + 1, steps)
            return f"{kind} " + self._declare(ref, inner, depth + 1, steps)
        if kind == "array":
            return self._declare(ref, f"{inner}[{t.nelems}]", depth + 1, steps)
        if kind == "func_proto":
            params = [("..." if (p, pt) == ("", 0) else self._declare(self.type(pt), "", depth + 1, steps))
                      for p, pt in t.params]
            return self._declare(ref, f"{inner}({', '.join(params) or 'void'})", depth + 1, steps)
        if kind == "func":
            return self._declare(ref, t.name, depth + 1, steps)
        if kind == "var":
            return self._declare(ref, t.name, depth + 1, steps)
        return self._declare(ref, inner, depth + 1, steps)  # type_tag, decl_tag: the type itself

    def _unqualified(self, t: Type) -> Type:
        seen = 0
        while t.kind in _QUALIFIERS or t.kind == "type_tag":
            seen += 1
            if seen > MAX_DEPTH:
                raise BTFError(f"{self.name}: type {t.id}: its qualifiers loop")
            assert t.ref is not None
            t = self.type(t.ref)
        return t

    # --- checking everything ----------------------------------------------------------
    def validate(self) -> None:
        """Decode every type, follow every chain, look up every name: a malformed blob
        raises BTFError here rather than when its bad part is first used."""
        for t in self.types():
            if t.kind in _TRANSPARENT:
                self.strip(t)
            self.describe(t)
            if t.kind in _RECORDS:
                self.members(t)
        self._index()


def _split_kind(name: str, kind: str | None) -> tuple[str, str | None]:
    """"struct sock" -> ("sock", "struct"); a kind given as well must agree."""
    first, sep, rest = name.strip().partition(" ")
    if sep and first in ("struct", "union", "enum"):
        if kind is not None and kind != first and not (first == "enum" and kind == "enum64"):
            raise BTFError(f"{name!r} names a {first}, not a {kind}")
        return rest.strip(), kind or first
    return name, kind


def _sections(data: bytes, name: str, split: bool) -> tuple[str, memoryview, bytes]:
    """The byte order, type section and string section of a BTF blob, checked as
    the kernel checks a header (kernel/bpf/btf.c btf_parse_hdr, btf_parse_str_sec)."""
    if len(data) < HEADER_SIZE:
        raise BTFError(f"{name}: truncated BTF header: {len(data)} bytes, a header is {HEADER_SIZE}")
    (magic,) = struct.unpack_from("<H", data)
    if magic == MAGIC:
        endian = "<"
    elif magic == int.from_bytes(MAGIC.to_bytes(2, "little"), "big"):  # written big-endian
        endian = ">"
    else:
        raise BTFError(f"{name}: not BTF: magic {data[:2].hex()}, expected 0xeb9f")
    _magic, version, _flags, hdr_len, type_off, type_len, str_off, str_len = struct.unpack_from(
        endian + "HBBIIIII", data)
    if version != 1:
        raise BTFError(f"{name}: BTF version {version}; this reader knows version 1")
    if not HEADER_SIZE <= hdr_len <= len(data):
        raise BTFError(f"{name}: BTF header length {hdr_len} (at least {HEADER_SIZE}, at most the "
                       f"blob's {len(data)} bytes)")
    if any(data[HEADER_SIZE:hdr_len]):
        raise BTFError(f"{name}: BTF header of {hdr_len} bytes has unknown non-zero fields")
    body = len(data) - hdr_len
    for what, off, size in (("type", type_off, type_len), ("string", str_off, str_len)):
        if off + size > body:
            raise BTFError(f"{name}: the {what} section [{off}, +{size}) runs past the end of the "
                           f"BTF ({body} bytes after the header)")
    if type_off % 4:
        raise BTFError(f"{name}: the type section's offset {type_off} is not 4-byte aligned")
    if type_off < str_off < type_off + type_len or str_off < type_off < str_off + str_len:
        raise BTFError(f"{name}: the type and string sections overlap")
    strings = data[hdr_len + str_off:hdr_len + str_off + str_len]
    if not split and (not strings or strings[0]):
        raise BTFError(f"{name}: the string section does not start with an empty string")
    if strings and strings[-1]:
        raise BTFError(f"{name}: the string section does not end with a NUL")
    types = memoryview(data)[hdr_len + type_off:hdr_len + type_off + type_len]
    return endian, types, strings


def _walk(types: memoryview, endian: str, start_id: int, name: str
          ) -> tuple[array[int], array[int], array[int]]:
    """Where each type's record starts, its name offset and its info word."""
    offsets, names, infos = array("I"), array("I"), array("I")
    add_offset, add_name, add_info = offsets.append, names.append, infos.append
    unpack = struct.Struct(endian + "II").unpack_from
    fixed, per_item, nkinds = _FIXED, _PER_ITEM, len(KINDS)
    end = len(types)
    at = 0
    while at < end:
        if at + TYPE_SIZE > end:
            raise BTFError(f"{name}: type {start_id + len(offsets)} at offset {at} of the type "
                           f"section is truncated ({end - at} bytes left of its {TYPE_SIZE})")
        name_off, info = unpack(types, at)
        kind = info >> 24 & 0x1F
        if not 0 < kind < nkinds:
            raise BTFError(f"{name}: type {start_id + len(offsets)} at offset {at} has unknown "
                           f"kind {kind}")
        add_offset(at)
        add_name(name_off)
        add_info(info)
        at += TYPE_SIZE + fixed[kind] + per_item[kind] * (info & 0xFFFF)
    if at != end:
        last = offsets[-1]
        raise BTFError(f"{name}: type {start_id + len(offsets) - 1} at offset {last} of the type "
                       f"section is truncated: its record needs {at - last} bytes, "
                       f"{end - last} are left")
    return offsets, names, infos
