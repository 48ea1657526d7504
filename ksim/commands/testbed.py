"""``ksim testbed up | prepare | status | exec -- CMD | down``: the live Linux testbed.

A Debian 6.1 kernel in QEMU (KVM when it works, TCG otherwise) with the
kerninst module and kerninstd inside; ksim reaches it as live://127.0.0.1:PORT.
Downloads and builds are cached in ~/.cache/ksim/testbed/; once the cache holds
the kernel and the built module, ``up`` needs neither apt nor the network
(``prepare`` fills the cache without booting; ``--offline`` refuses to fetch and
names what is missing instead).  The kernel is the one the cache holds;
``--refresh`` moves to the newest 6.1 ABI apt offers.

``--arch arm64`` acts on the arm64 testbed (Debian's arm64 kernel of the same
ABI in qemu-system-aarch64, kerninstd on port 7071); ``--name NAME`` on a further
guest of its own (files in ~/.cache/ksim/testbed/instances/NAME), so that
several run at once.  Without either, the x86-64 testbed on port 7070.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Any

from ksim.cli import add_json_flag, emit_json, help_text
from ksim.errors import UsageError


def port_arg(text: str) -> int:
    """argparse type of a TCP port: a whole number from 1 to 65535."""
    if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"a port is a whole number from 1 to 65535, not {text!r}")
    return int(text)


def seconds_arg(text: str) -> float:
    """argparse type of a timeout: a finite number of seconds above 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"a timeout is a number of seconds above 0, not {text!r}")
    return value


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("testbed", help="boot, query or stop the live Linux testbed (QEMU)",
                       description=help_text(__doc__), formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = p.add_subparsers(dest="action", metavar="ACTION", help="what to do")
    actions.required = True
    up = actions.add_parser("up", help="boot the testbed (reuses a running one)")
    up.add_argument("--port", type=port_arg, default=None, help="host port for kerninstd (default 7070)")
    up.add_argument("--accel", choices=("auto", "kvm", "tcg"), default="auto",
                    help="QEMU accelerator (default: auto, KVM when /dev/kvm works, else TCG)")
    up.add_argument("--timeout", type=seconds_arg, default=300.0, help="boot timeout in seconds")
    pre = actions.add_parser("prepare", help="fetch, install and build what `up` needs, "
                             "without booting")
    for q in (up, pre):
        q.add_argument("--kmod", default=None, metavar="DIR",
                       help="arm64: build kerninst.ko from DIR (a kbuild Makefile and its "
                            "sources; kmod/kerninst.h when DIR lacks it) instead of kmod/, "
                            "e.g. a module under development, or tests/kmod_arm64_standin "
                            "(a stand-in that answers only the version, info and state)")
        q.add_argument("--with", dest="tools", action="append", default=[], metavar="TOOL",
                       help="a program the guest runs (bpftrace): added to the arm64 guest's "
                            "userland, installed on the host for the x86-64 guest")
        q.add_argument("--offline", action="store_true",
                       help="use only the cache and the installed packages; name what is "
                            "missing instead of fetching it")
        q.add_argument("--refresh", action="store_true",
                       help="use the newest 6.1 kernel ABI apt offers, not the cached one")
    st = actions.add_parser("status", help="is the testbed up, and where")
    st.add_argument("--all", action="store_true",
                    help="every instance that has been booted (state files), up or not")
    ex = actions.add_parser("exec", help="run a shell command in the guest")
    ex.add_argument("--timeout", type=seconds_arg, default=120.0,
                    help="seconds the command may run (default 120)")
    ex.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD",
                    help="the shell command, after --")
    dn = actions.add_parser("down", help="stop the testbed; leaves no process behind")
    for q in (up, pre, st, ex, dn):
        add_json_flag(q)
        q.add_argument("--arch", choices=("x86_64", "arm64"), default=None,
                       help="the guest's architecture (default x86_64; arm64: the arm64 testbed)")
    for q in (up, st, ex, dn):
        q.add_argument("--name", default=None, metavar="NAME",
                       help="a testbed instance of its own (default: the one --arch names)")
    p.set_defaults(func=run)


def _progress(json_mode: bool) -> Any:
    t0 = time.monotonic()

    def show(message: str) -> None:
        print(f"[{time.monotonic() - t0:6.1f}s] {message}", file=sys.stderr, flush=True)

    return show


def _kmod(args: argparse.Namespace) -> Any:
    if args.kmod is None:
        return None
    from pathlib import Path

    from ksim.live import arm64bed

    return arm64bed.module_dir_sources(Path(args.kmod))


def _label(inst: Any) -> str:
    return "" if not inst.name else f"{inst.name} ({inst.arch}) "


def run(args: argparse.Namespace) -> int:
    from ksim.live import testbed

    progress = _progress(args.json)
    if args.action == "prepare":
        ready = testbed.prepare(offline=args.offline, refresh=args.refresh, progress=progress,
                                arch=args.arch or "x86_64", module_sources=_kmod(args),
                                tools=tuple(args.tools))
        if args.json:
            emit_json(ready)
        else:
            print(f"testbed ready to boot: kernel {ready['abi']} ({ready['arch']}), module "
                  f"{ready['module']}, {len(ready['guest_modules'])} guest modules "
                  f"(cache {ready['cache']})")
        return 0
    if args.action == "status" and args.all:
        every = testbed.instances()
        if args.json:
            emit_json(every)
        for state in [] if args.json else every:
            name = state.get("instance") or "default"
            print(f"{name:16} {state.get('arch', 'x86_64'):7} "
                  + (f"up   {state['address']} (kernel {state.get('kernel')}, qemu pid "
                     f"{state['pid']})" if state["up"] else "down"))
        return 0
    inst = testbed.resolve_instance(args.name, args.arch)
    if args.action == "up":
        state = testbed.up(port=args.port, accel=args.accel, timeout=args.timeout,
                           offline=args.offline, refresh=args.refresh, progress=progress,
                           instance=inst, module_sources=_kmod(args), tools=tuple(args.tools))
        if args.json:
            emit_json(state)
        else:
            print(f"testbed {_label(inst)}up ({state['accel'].upper()}, kernel {state.get('kernel')}, "
                  f"booted in {state.get('boot_seconds')} s)")
            print(f"address: {state['address']}")
            print(f"token:   {state['token_file']}")
        return 0
    if args.action == "status":
        state = testbed.status(inst)
        if args.json:
            emit_json(state)
        elif state["up"]:
            print(f"up: {state['address']} ({state['accel'].upper()}, kernel {state.get('kernel')}, "
                  f"qemu pid {state['pid']}); token {state['token_file']}")
        else:
            print("down" + (" (qemu running but kerninstd not answering)"
                            if state.get("qemu_running") else ""))
        return 0 if state["up"] else 1
    if args.action == "exec":
        cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
        if not cmd:
            raise UsageError("ksim testbed exec", "no command (ksim testbed exec -- CMD)")
        result = testbed.exec_(" ".join(cmd), timeout=args.timeout, instance=inst)
        if args.json:
            emit_json(result)
        else:
            sys.stdout.write(result["stdout"])
            sys.stderr.write(result["stderr"])
        return int(result["rc"])
    if args.action == "down":
        result = testbed.down(progress=progress, instance=inst)
        if args.json:
            emit_json(result)
        else:
            print("stopped" if result["stopped"] else "was not running")
        return 0
    return 2
