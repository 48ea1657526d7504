"""``ksim points FUNC``: a function's instrumentation points."""

from __future__ import annotations

import argparse

from ksim.cli import add_json_flag, emit_json
from ksim.commands.funcs import add_image_arg


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("points", help="list a function's instrumentation points",
                              description="Entry, exits, basic blocks and call sites of FUNC.")
    p.add_argument("function", metavar="FUNC")
    add_image_arg(p)
    add_json_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ksim.analysis import analyze
    from ksim.image.resolve import open_image

    analysis = analyze(open_image(args.image), args.function)
    points = analysis.points
    if args.json:
        emit_json(points.as_dict())
        return 0
    by_addr = {i.address: i for i in analysis.insns}
    print(f"{'KIND':<9} {'ADDRESS':<18}  INSTRUCTION")
    for point in points.all():
        insn = by_addr.get(point.address)
        text = f"{insn.mnemonic} {insn.op_str}".rstrip() if insn else ""
        print(f"{point.kind.value:<9} {point.address:#018x}  {text}")
    return 0
