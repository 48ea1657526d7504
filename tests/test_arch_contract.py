"""Generic code reaches an architecture only through the contract.

The engine above the architecture plug-ins (analysis, snippets, splice planning,
the Manager and what is built on it) asks ``ksim.arch.get_arch`` for an
:class:`~ksim.arch.base.Arch` and uses it and the plain data of
``ksim.arch.base``; it never imports an architecture package and never branches
on an architecture's name.  These tests read the source (``ast``, function-local
imports included) so that a second architecture can be added as a plug-in.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

import ksim
from ksim.arch import REGISTRY

PACKAGE = Path(ksim.__file__).resolve().parent
#: the generic modules and packages (under ksim/)
GENERIC = ("analysis", "splice", "snippets", "kapi", "probes", "replace", "callees", "timers",
           "components", "sampling", "trace")
#: what generic code may import of ksim.arch
ALLOWED = ("ksim.arch", "ksim.arch.base")
#: names of architectures: the registered ones and their aliases, and the usual
#: names of others, which a plug-in would register under
ARCH_NAMES = frozenset(name.lower() for name in REGISTRY) | {
    "x86_64", "x86-64", "amd64", "x86", "i386", "i686", "aarch64", "arm64", "arm",
    "riscv64", "ppc64le", "s390x",
}


def generic_files() -> list[Path]:
    out: list[Path] = []
    for name in GENERIC:
        path = PACKAGE / name
        out += sorted(path.rglob("*.py")) if path.is_dir() else [path.with_suffix(".py")]
    return out


def module_of(path: Path) -> tuple[str, bool]:
    """(dotted module name, whether it is a package's __init__) of a file under ksim/."""
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


# --- the checks -------------------------------------------------------------------------------
def _forbidden(module: str) -> bool:
    """An architecture package or a module in one: ksim.arch.<name>[...], not base."""
    parts = module.split(".")
    return parts[:2] == ["ksim", "arch"] and len(parts) > 2 and parts[2] != "base"


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module a ``from ... import`` reads from."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _is_arch_package(name: str) -> bool:
    """Whether ``ksim.arch.<name>`` is a module of its own (a plug-in, or base)."""
    arch = PACKAGE / "arch"
    return (arch / name).is_dir() or (arch / f"{name}.py").is_file() or any(
        target.split(".")[2:3] == [name] for target in REGISTRY.values())


def arch_imports(source: str, module: str, is_package: bool = False) -> Iterator[tuple[int, str]]:
    """(line, module) of every import of an architecture package in ``source``:
    ``import``, ``from ... import`` (relative ones resolved, submodules imported by
    name from ksim.arch), and ``importlib.import_module`` / ``__import__`` of a
    literal name, wherever they are (module level or inside functions)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _forbidden(alias.name):
                    yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            origin = _resolve(node, module, is_package)
            if _forbidden(origin):
                yield node.lineno, origin
            elif origin == "ksim.arch":
                for alias in node.names:
                    name = f"ksim.arch.{alias.name}"
                    if _is_arch_package(alias.name) and _forbidden(name):
                        yield node.lineno, name
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            first = node.args[0]
            if (called in ("import_module", "__import__") and isinstance(first, ast.Constant)
                    and isinstance(first.value, str) and _forbidden(first.value)):
                yield node.lineno, first.value


def _dotted(node: ast.expr) -> list[str] | None:
    """``a.b.c`` as ["a", "b", "c"]; None for anything but names and attributes."""
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Attribute):
        inner = _dotted(node.value)
        return None if inner is None else inner + [node.attr]
    return None


def _names_arch(node: ast.expr) -> bool:
    """Whether ``node`` reads as an architecture or its name: a name or attribute
    with ``arch`` as a word of it (``arch``, ``arch_name``, ``image.arch``), or
    the ``name`` of one (``arch.name``, ``self.arch.name``)."""
    parts = _dotted(node)
    if not parts:
        return False
    if parts[-1] == "name" and len(parts) > 1:
        parts = parts[:-1]
    return "arch" in parts[-1].lower().split("_")


def _strings(node: ast.expr) -> list[str] | None:
    """The string literals ``node`` is (one, or a tuple/list/set display of them)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.Tuple | ast.List | ast.Set) and node.elts:
        found = [_strings(e) for e in node.elts]
        if all(f is not None and len(f) == 1 for f in found):
            return [f[0] for f in found if f]
    return None


_EQUALITY = (ast.Eq, ast.NotEq, ast.In, ast.NotIn, ast.Is, ast.IsNot)


def _compares_arch_name(op: ast.cmpop, a: ast.expr, b: ast.expr) -> bool:
    if not isinstance(op, _EQUALITY):
        return False
    for x, y in ((a, b), (b, a)):
        literals = _strings(y)
        if literals is not None and (_names_arch(x) or any(s.lower() in ARCH_NAMES for s in literals)):
            return True
    return False


def arch_name_comparisons(source: str) -> Iterator[tuple[int, str]]:
    """(line, source text) of every comparison of an architecture's name with a
    string literal: the other side reads as an architecture (``arch.name ==
    "x86_64"``, ``image.arch == "x86_64"``, ``arch_name in ("x86_64", ...)``), or
    the literal is an architecture's name whatever it is compared with; and
    ``match`` statements on an architecture with string cases."""
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_compares_arch_name(op, a, b)
                   for op, a, b in zip(node.ops, sides[:-1], sides[1:], strict=True)):
                yield node.lineno, ast.get_source_segment(source, node) or ""
        elif isinstance(node, ast.Match) and _names_arch(node.subject):
            for case in node.cases:
                if isinstance(case.pattern, ast.MatchValue) and _strings(case.pattern.value):
                    yield case.pattern.lineno, ast.get_source_segment(source, case.pattern) or ""


def arch_name_literals(source: str) -> Iterator[tuple[int, str]]:
    """(line, literal) of every string literal that is an architecture's name
    (``get_arch("x86_64")``, a table keyed by ``"x86_64"``), docstrings aside."""
    tree = ast.parse(source)
    docs = {id(n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
                and node.value.lower() in ARCH_NAMES):
            yield node.lineno, repr(node.value)


# --- the generic code keeps to the contract ----------------------------------------------------
def _where(path: Path, line: int) -> str:
    return f"{path.relative_to(PACKAGE.parent)}:{line}"


def test_the_generic_modules_are_there() -> None:
    files = generic_files()
    assert all(f.is_file() for f in files), [str(f) for f in files if not f.is_file()]
    assert len(files) > len(GENERIC)


def test_generic_code_imports_no_architecture_package() -> None:
    found = []
    for path in generic_files():
        module, is_package = module_of(path)
        for line, name in arch_imports(path.read_text(), module, is_package):
            found.append(f"{_where(path, line)}: imports {name}")
    assert not found, ("generic code must reach an architecture through ksim.arch.get_arch and "
                       "the Arch protocol (ksim.arch.base), never import one:\n  " + "\n  ".join(found))


def test_generic_code_never_compares_an_architecture_name() -> None:
    found = []
    for path in generic_files():
        for line, text in arch_name_comparisons(path.read_text()):
            found.append(f"{_where(path, line)}: {text}")
    assert not found, ("generic code must not branch on an architecture's name (ask the Arch "
                       "object instead):\n  " + "\n  ".join(found))


def test_generic_code_names_no_architecture() -> None:
    found = []
    for path in generic_files():
        for line, text in arch_name_literals(path.read_text()):
            found.append(f"{_where(path, line)}: {text}")
    assert not found, ("generic code must not name an architecture (the image or target names "
                       "it; ksim.arch.get_arch turns the name into an Arch):\n  " + "\n  ".join(found))


# --- the checks themselves: each form is caught, look-alikes are not ---------------------------
@pytest.mark.parametrize("source,module,expected", [
    ("import ksim.arch.x86_64", "ksim.kapi", ["ksim.arch.x86_64"]),
    ("import ksim.arch.x86_64.reader as r", "ksim.kapi", ["ksim.arch.x86_64.reader"]),
    ("from ksim.arch.x86_64.reader import decode", "ksim.kapi", ["ksim.arch.x86_64.reader"]),
    ("from ksim.arch import x86_64", "ksim.kapi", ["ksim.arch.x86_64"]),
    ("from ksim.arch import get_arch, x86_64", "ksim.kapi", ["ksim.arch.x86_64"]),
    ("def f():\n    from ksim.arch.x86_64 import ARCH\n    return ARCH", "ksim.kapi",
     ["ksim.arch.x86_64"]),
    ("from ..arch.x86_64 import regs", "ksim.analysis.cfg", ["ksim.arch.x86_64"]),
    ("from ..arch import x86_64", "ksim.analysis.cfg", ["ksim.arch.x86_64"]),
    ("import importlib\nimportlib.import_module('ksim.arch.x86_64')", "ksim.kapi",
     ["ksim.arch.x86_64"]),
    ("from ksim.arch import get_arch\nfrom ksim.arch.base import Arch, Flow", "ksim.kapi", []),
    ("import ksim.arch\nimport ksim.arch.base\nfrom ksim.arch import base", "ksim.kapi", []),
    ("from ..arch.base import Flow\nfrom . import cfg", "ksim.analysis.points", []),
    ("from ksim.archive import x86_64", "ksim.kapi", []),
])
def test_imports_are_found(source: str, module: str, expected: list[str]) -> None:
    assert [name for _line, name in arch_imports(source, module)] == expected


@pytest.mark.parametrize("source,caught", [
    ('arch.name == "x86_64"', True),
    ('self.arch.name != "aarch64"', True),
    ('image.arch == "x86_64"', True),
    ('arch_name in ("x86_64", "amd64")', True),
    ('"x86_64" == support.name', True),
    ('kind in {"amd64"}', True),
    ('target.arch.name == "riscv"', True),
    ('match arch.name:\n    case "x86_64":\n        pass', True),
    ('e.name == "printf"', False),
    ('insn.mnemonic == "int3"', False),
    ('archive == "tar"', False),
    ('arch.name == other.arch.name', False),
    ('arch is None', False),
])
def test_name_comparisons_are_found(source: str, caught: bool) -> None:
    assert bool(list(arch_name_comparisons(source))) is caught


@pytest.mark.parametrize("source,caught", [
    ('get_arch("x86_64")', True),
    ('CONVENTIONS = {"x86_64": None}', True),
    ('"""Jump tables on x86_64."""\n"x86_64"', False),
    ('def f():\n    """x86_64"""', False),
    ('error = "not an x86-64 ELF"', False),
])
def test_name_literals_are_found(source: str, caught: bool) -> None:
    assert bool(list(arch_name_literals(source))) is caught
