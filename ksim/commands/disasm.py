"""``ksim disasm FUNC``: a function's basic blocks and instructions."""

from __future__ import annotations

import argparse

from ksim.cli import add_json_flag, emit_json
from ksim.commands.funcs import add_image_arg


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("disasm", help="disassemble a function by basic block",
                              description="Basic blocks (with successors) and instructions of FUNC.")
    p.add_argument("function", metavar="FUNC")
    add_image_arg(p)
    add_json_flag(p)
    p.set_defaults(func=run)


def describe(analysis) -> dict:
    blocks = []
    for block in analysis.blocks:
        blocks.append({
            "start": block.start,
            "end": block.end,
            "succs": list(block.succs),
            "reachable": block.reachable,
            "instructions": [
                {"address": i.address, "bytes": i.raw.hex(), "mnemonic": i.mnemonic, "op_str": i.op_str}
                for i in block.insns
            ],
        })
    func = analysis.function
    return {"function": func.name, "address": func.address, "size": func.size,
            "module": func.module, "blocks": blocks}


def run(args: argparse.Namespace) -> int:
    from ksim.analysis import analyze
    from ksim.image.resolve import open_image

    image = open_image(args.image)
    analysis = analyze(image, args.function)
    if args.json:
        emit_json(describe(analysis))
        return 0
    func = analysis.function
    print(f"{func.name} @ {func.address:#x}, {func.size} bytes, {len(analysis.blocks)} blocks")
    for block in analysis.blocks:
        succs = ", ".join(f"{s:#x}" for s in block.succs) or "-"
        note = "" if block.reachable else "  (unreachable)"
        print(f"\nblock {block.start:#x}-{block.end:#x} -> {succs}{note}")
        if block.data:
            print(f"  {block.start:#x}  <{block.size} undecodable bytes>")
        for i in block.insns:
            print(f"  {i.address:#x}  {i.raw.hex():<24} {i.mnemonic} {i.op_str}".rstrip())
    return 0
