"""What a verification campaign checks: the image, its points, its cases.

A case of ``ksim verify`` is one differential run (``ksim.differential``): a point,
the splicing policy the Manager is asked with, a snippet and a machine seed.  It
is named by one line of text, its *id*, which ``ksim verify --case ID`` takes back::

    POINT:POLICY:SNIPPET:SEED        e.g.  vfs_read:auto:counter:3735928559

POINT is a function's name (its entry point, as the Manager finds it: after the
ftrace call when there is one) or ``NAME+0xOFF`` (the instruction at that offset).
A name that several functions of the image carry (static functions of the same
name) is given with the function's address: ``NAME@0xADDR``.  The seeds of a
campaign are derived from its ``--seed``, the point and the case's number, so the
same command makes the same cases whatever runs them.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import random
import re
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ksim.campaign.errors import BadCase
from ksim.differential import SNIPPETS
from ksim.errors import KsimError, UnknownSymbol
from ksim.image.image import Image
from ksim.image.model import Function
from ksim.splice.sites import SiteFacts

#: what ``--splice`` takes: the Manager's policies, or one tactic exactly
POLICIES = ("auto", "jmp", "trap", "jmp+displace", "springboard")
#: the kinds of points --points takes (PointKind's values)
POINT_KINDS = ("entry", "exit", "block", "callsite")
#: the image checked when none is named
DEFAULT_IMAGE = "debian"
#: Debian's arm64 kernel of the same release (a flat Image and its kallsyms table)
ARM64_IMAGE = "debian-arm64"


# --- the image ----------------------------------------------------------------------
@dataclass(frozen=True)
class ImageSource:
    """Where a campaign's kernel image comes from: an ELF file, with a symbol list in
    /proc/kallsyms format when the ELF has no symbols (Debian's vmlinux).  ``name`` is
    what ``--image`` said (``debian``, ``toy``, a path)."""

    name: str
    elf: str
    kallsyms: str | None = None
    #: a flat arm64 Image (no ELF) linked at this address, with ``kallsyms``
    base: int | None = None

    def load(self) -> Image:
        from ksim.image import load_image, load_kallsyms

        if self.base is not None and self.kallsyms is not None:
            from ksim.bench.kernel import load_arm64_image

            return load_arm64_image(Path(self.elf), Path(self.kallsyms), self.base)
        if self.kallsyms is not None:
            return load_kallsyms(self.kallsyms, self.elf)
        return load_image(self.elf)

    def files(self) -> dict[str, bytes]:
        """The files' bytes, to ship to machines that do not have them."""
        out = {"elf": Path(self.elf).read_bytes()}
        if self.kallsyms is not None:
            out["kallsyms"] = Path(self.kallsyms).read_bytes()
        return out

    @staticmethod
    def from_files(name: str, files: dict[str, bytes], directory: Path,
                   base: int | None = None) -> ImageSource:
        """The same image from shipped bytes, written once into ``directory``."""
        directory.mkdir(parents=True, exist_ok=True)
        paths: dict[str, str] = {}
        for key, data in files.items():
            path = directory / key
            if not path.exists() or path.stat().st_size != len(data):
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_bytes(data)
                tmp.replace(path)
            paths[key] = str(path)
        return ImageSource(name, paths["elf"], paths.get("kallsyms"), base)


def image_source(spec: str | None, kallsyms: str | None = None) -> ImageSource:
    """``--image``: None or "debian" (the testbed's Debian kernel, fetched once into
    the cache ksim.bench.kernel shares with the testbed; "debian:e100.ko" and
    "debian:ext4.ko" its modules there; "debian-arm64" Debian's arm64 kernel of the
    same release), a bundled image's name
    ("toy", "toy-arm64") or a path to an ELF kernel or module (with ``kallsyms``, a
    symbol list for an ELF without symbols)."""
    from ksim.errors import ImageError

    if spec == ARM64_IMAGE:
        if kallsyms is not None:
            raise BadCase("--kallsyms goes with --image PATH, not the Debian kernel")
        from ksim.bench.kernel import debian_kernel

        a = debian_kernel("arm64")
        return ImageSource(ARM64_IMAGE, str(a.image), str(a.kallsyms), a.base)
    if spec is None or spec == DEFAULT_IMAGE or spec.startswith(DEFAULT_IMAGE + ":"):
        if kallsyms is not None:
            raise BadCase("--kallsyms goes with --image PATH, not the Debian kernel")
        from ksim.bench.kernel import debian_kernel

        k = debian_kernel()
        if spec is None or spec == DEFAULT_IMAGE:
            return ImageSource(DEFAULT_IMAGE, str(k.vmlinux), str(k.kallsyms))
        modules = {"e100.ko": k.e100, "ext4.ko": k.ext4}
        module = spec.split(":", 1)[1]
        if module not in modules:
            raise ImageError(f"--image {spec}: the Debian kernel's cache holds "
                             f"{', '.join(f'{DEFAULT_IMAGE}:{m}' for m in modules)} (or give a "
                             "module's path)")
        return ImageSource(spec, str(modules[module]))
    from ksim.image.resolve import image_path

    path = image_path(spec)
    if not os.path.isfile(path):
        raise ImageError(f"no kernel image at {path!r}: give a bundled image (toy, toy-arm64) "
                         "or the path of a vmlinux or module")
    if kallsyms is not None and not os.path.isfile(kallsyms):
        raise ImageError(f"no symbol list at {kallsyms!r}")
    return ImageSource(spec, path, kallsyms)


# --- cases ----------------------------------------------------------------------------
@dataclass(frozen=True)
class VerifyCase:
    """One case: the point (a function, by its address, and an offset into it, or
    None for its entry point), the policy, the snippet and the seed; ``point`` is
    how its id names the point."""

    point: str
    function: int
    offset: int | None
    policy: str
    snippet: str
    seed: int

    @property
    def id(self) -> str:
        return f"{self.point}:{self.policy}:{self.snippet}:{self.seed}"

    def as_tuple(self) -> tuple[Any, ...]:
        return (self.point, self.function, self.offset, self.policy, self.snippet, self.seed)


@dataclass(frozen=True)
class Target:
    """A point a campaign checks: function ``func``'s entry (``offset`` None) or the
    instruction at ``offset``; ``name`` is how ids name it."""

    name: str
    func: Function
    offset: int | None = None


def point_name(image: Image, func: Function, offset: int | None) -> str:
    """How a case id names the point (see the module doc)."""
    base = f"{func.name}@{func.address:#x}" if _duplicated(image, func) else func.name
    return base if offset is None else f"{base}+{offset:#x}"


_DUPLICATES: weakref.WeakKeyDictionary[Image, frozenset[str]] = weakref.WeakKeyDictionary()


def _duplicated(image: Image, func: Function) -> bool:
    """Whether another function of the image (at another address) has ``func``'s name."""
    names = _DUPLICATES.get(image)
    if names is None:
        seen: dict[str, int] = {}
        dup: set[str] = set()
        for f in image.functions:
            if seen.setdefault(f.name, f.address) != f.address:
                dup.add(f.name)
        names = _DUPLICATES[image] = frozenset(dup)
    return func.name in names


def case_seed(seed: int, point: str, k: int) -> int:
    """The machine seed of case ``k`` at ``point`` in a campaign seeded ``seed``."""
    digest = hashlib.blake2b(repr(("ksim-verify", seed, point, k)).encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


def make_cases(targets: Sequence[Target], count: int, seed: int, policy: str = "auto",
               snippet: str = "counter") -> list[VerifyCase]:
    """``count`` cases at each target, seeds derived from ``seed``."""
    return [VerifyCase(t.name, t.func.address, t.offset, policy, snippet, case_seed(seed, t.name, k))
            for t in targets for k in range(count)]


# --- selecting points -------------------------------------------------------------------
def select(image: Image, pattern: str, *, sample: int | None = None, seed: int = 0,
           kinds: Sequence[str] = ("entry",), facts: SiteFacts | None = None) -> list[Target]:
    """The points ``--functions`` names: a comma-separated list of ``all``, wildcards
    (``vfs_*``: every matching function), names and ``NAME+OFFSET`` (an
    instruction), in address order, each once.  A function gives its points of
    ``kinds`` (POINT_KINDS; its entry by default: no analysis needed here; the
    others from ``facts``).  ``sample`` keeps a seeded sample of that many points.
    UnknownSymbol when a name or wildcard matches nothing."""
    from ksim.commands.count import parse_point

    items = [p.strip() for p in pattern.split(",")]
    if not pattern.strip() or not all(items):
        raise BadCase(f"--functions {pattern!r}: an empty item (names, wildcards or 'all', "
                      "separated by commas)")
    chosen: dict[tuple[int, int | None], Target] = {}

    def add(func: Function, offset: int | None) -> None:
        key = (func.address, offset)
        if key not in chosen:
            chosen[key] = Target(point_name(image, func, offset), func, offset)

    for item in items:
        if item == "all":
            for f in image.functions:
                add(f, None)
            continue
        spec = parse_point(item)
        if spec.wildcard:
            matched = [f for f in image.functions if fnmatch.fnmatchcase(f.name, item)]
            if not matched:
                raise UnknownSymbol(item, [])
            for f in matched:
                add(f, None)
        elif spec.address is not None:
            func = image.function_at(spec.address)
            if func is None:
                from ksim.errors import OutsideText

                raise OutsideText(f"{spec.address:#x} is not inside a known function")
            offset = spec.address - func.address
            add(func, offset or None)
        else:
            assert spec.name is not None
            func = image.function(spec.name)
            if spec.offset and func.size and spec.offset >= func.size:
                from ksim.errors import OutsideText

                raise OutsideText(f"{item}: the offset {spec.offset:#x} is past the end of "
                                  f"{func.name} ({func.size:#x} bytes)")
            add(func, spec.offset or None)
    targets = sorted(chosen.values(), key=_order)
    if tuple(kinds) != ("entry",):
        if facts is None:
            raise KsimError("points of other kinds than entries need the image's site facts")
        return _expand(image, facts, targets, kinds, sample, seed)
    return sample_of(targets, sample, seed)


def sample_of(targets: Sequence[Target], sample: int | None, seed: int) -> list[Target]:
    """A seeded sample of ``sample`` targets (all of them when None), in address order."""
    if sample is None or sample >= len(targets):
        return list(targets)
    rng = random.Random(repr(("ksim-verify-sample", seed)))
    return sorted(rng.sample(list(targets), sample), key=_order)


def _order(t: Target) -> tuple[int, int]:
    return (t.func.address, -1 if t.offset is None else t.offset)


def _expand(image: Image, facts: SiteFacts, targets: list[Target], kinds: Sequence[str],
            sample: int | None, seed: int) -> list[Target]:
    """Each function's points of ``kinds`` (NAME+OFFSET targets stay as they are).
    With ``sample``, functions are taken in a seeded order until that many points
    are found: only those functions are analysed."""
    order = list(targets)
    if sample is not None:
        random.Random(repr(("ksim-verify-sample", seed))).shuffle(order)
    out: dict[tuple[int, int | None], Target] = {}
    for t in order:
        points = [t] if t.offset is not None else _points_of(image, facts, t.func, kinds)
        for p in points:
            out.setdefault((p.func.address, p.offset), p)
        if sample is not None and len(out) >= sample:
            break
    chosen = list(out.values())[:sample] if sample is not None else list(out.values())
    return sorted(chosen, key=_order)


def _points_of(image: Image, facts: SiteFacts, func: Function, kinds: Sequence[str]) -> list[Target]:
    """The function's points of ``kinds``; its entry alone when it cannot be analysed
    (its case then says why)."""
    from ksim.analysis.points import PointKind

    try:
        entry = facts.entry(func).address
        addresses: list[int | None] = [None] if "entry" in kinds else []
        for kind in kinds:
            if kind != "entry":
                addresses += [p.address for p in facts.points(func, PointKind(kind))
                              if not ("entry" in kinds and p.address == entry)]
    except KsimError:
        return [Target(point_name(image, func, None), func, None)]
    offsets = sorted({None if a is None else a - func.address for a in addresses},
                     key=lambda o: -1 if o is None else o)
    return [Target(point_name(image, func, o), func, o) for o in offsets]


# --- ids ----------------------------------------------------------------------------------
_POINT = re.compile(r"(?P<name>[^@+:\s]+)(?:@(?P<at>0[xX][0-9a-fA-F]+))?"
                    r"(?:\+(?P<off>0[xX][0-9a-fA-F]+|0|[1-9][0-9]*))?\Z")


def parse_case(image: Image, text: str) -> VerifyCase:
    """The case a ``--case`` id names (see the module doc); BadCase saying what is
    wrong with it, UnknownSymbol for a function the image does not have."""
    shown = repr(text) if len(text) <= 120 else repr(text[:120]) + "..."
    parts = text.rsplit(":", 3)
    if len(parts) != 4:
        raise BadCase(f"--case {shown}: expected POINT:POLICY:SNIPPET:SEED "
                      "(as a summary's reproducer prints it)")
    point, policy, snippet, seed_text = parts
    if policy not in POLICIES:
        raise BadCase(f"--case {shown}: unknown policy {policy!r} (one of {', '.join(POLICIES)})")
    if snippet not in SNIPPETS:
        raise BadCase(f"--case {shown}: unknown snippet {snippet!r} (one of {', '.join(SNIPPETS)})")
    if not seed_text.isascii() or not seed_text.isdigit() or int(seed_text) >= 1 << 64:
        raise BadCase(f"--case {shown}: the seed {seed_text!r} is not a whole number below 2**64")
    m = _POINT.match(point)
    if m is None:
        raise BadCase(f"--case {shown}: the point {point!r} is not NAME, NAME+0xOFF or "
                      "NAME@0xADDR[+0xOFF]")
    name = m["name"]
    if m["at"] is not None:
        at = int(m["at"], 16)
        found = next((f for f in image.functions if f.address == at and f.name == name), None)
        if found is None:
            raise BadCase(f"--case {shown}: no function {name} at {m['at']} in {image.module}")
        func = found
    else:
        func = image.function(name)
    offset = int(m["off"], 0) if m["off"] is not None else None
    if offset is not None and func.size and offset >= func.size:
        raise BadCase(f"--case {shown}: the offset {offset:#x} is past the end of {func.name} "
                      f"({func.size:#x} bytes)")
    return VerifyCase(point, func.address, offset, policy, snippet, int(seed_text))


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise KsimError(f"unknown splice policy {policy!r}; use one of {', '.join(POLICIES)}")
    return policy
