"""``ksim funcs``: list an image's functions."""

from __future__ import annotations

import argparse
import fnmatch
from typing import Any

from ksim.cli import add_json_flag, emit_json


def add_image_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--image", default="toy",
                        help="bundled image name or path to an ELF kernel/module (default: toy)")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("funcs", help="list the functions of a kernel image",
                              description="List functions: name, address, size, basic blocks, module.")
    add_image_arg(p)
    p.add_argument("--match", metavar="GLOB", help="only functions whose name matches GLOB")
    add_json_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ksim.analysis import analyze
    from ksim.image.resolve import open_image

    image = open_image(args.image)
    rows: list[dict[str, Any]] = []
    for func in image.functions:
        if args.match and not fnmatch.fnmatchcase(func.name, args.match):
            continue
        blocks = len(analyze(image, func).points.blocks)
        rows.append({"name": func.name, "address": func.address, "size": func.size,
                     "blocks": blocks, "module": func.module})
    if args.json:
        emit_json(rows)
        return 0
    width = max([len(r["name"]) for r in rows] + [4])
    print(f"{'ADDRESS':<18}  {'SIZE':>6}  {'BLOCKS':>6}  {'NAME':<{width}}  MODULE")
    for r in rows:
        print(f"{r['address']:#018x}  {r['size']:>6}  {r['blocks']:>6}  {r['name']:<{width}}  {r['module']}")
    print(f"{len(rows)} function(s)")
    return 0
