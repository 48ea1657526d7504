"""``ksim images``: list the bundled kernel images, and build them.

    ksim images [--json]                      name, arch, built ELF path, function count
    ksim images build [NAME] [--force] [--json]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ksim.cli import add_json_flag, emit_json


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("images", help="list or build the bundled kernel images",
                              description="List the bundled kernel images (building them on first "
                              "use), or rebuild one.")
    add_json_flag(p)
    p.set_defaults(func=run)
    sub = p.add_subparsers(dest="images_command", metavar="ACTION")
    b = sub.add_parser("build", help="build an image (all when no NAME)",
                       description="Build a bundled image from source into the ksim cache.")
    b.add_argument("name", nargs="?", help="image name (default: every image)")
    b.add_argument("--force", action="store_true", help="rebuild even if a build for these sources exists")
    add_json_flag(b)
    b.set_defaults(func=run_build)


def count_functions(elf_path: Path) -> int:
    """Number of STT_FUNC symbols in the ELF."""
    from elftools.elf.elffile import ELFFile
    from elftools.elf.sections import SymbolTableSection

    with open(elf_path, "rb") as f:
        symtab = ELFFile(f).get_section_by_name(".symtab")
        if not isinstance(symtab, SymbolTableSection):
            return 0
        return sum(s["st_info"]["type"] == "STT_FUNC" for s in symtab.iter_symbols())


def _row(name: str, force: bool = False) -> dict:
    from ksim import images

    spec = images.get(name)
    path = images.build(name, force=force)
    return {"name": spec.name, "arch": spec.arch, "path": str(path),
            "functions": count_functions(path)}


def _print_table(rows: list[dict]) -> None:
    width = max([len(r["name"]) for r in rows] + [4])
    print(f"{'NAME':<{width}}  {'ARCH':<7}  {'FUNCS':>5}  PATH")
    for r in rows:
        print(f"{r['name']:<{width}}  {r['arch']:<7}  {r['functions']:>5}  {r['path']}")


def run(args: argparse.Namespace) -> int:
    from ksim import images

    rows = [_row(name) for name in images.names()]
    if args.json:
        emit_json(rows)
    else:
        _print_table(rows)
    return 0


def run_build(args: argparse.Namespace) -> int:
    from ksim import images

    names = [args.name] if args.name else images.names()
    rows = [_row(name, force=args.force) for name in names]
    if args.json:
        emit_json(rows)
    else:
        _print_table(rows)
    return 0
