"""QemuMachine: one qemu-system-x86_64 process, driven through QMP and the gdbstub.

The machine starts QEMU stopped (``-S``) with a gdbstub on a free local TCP port,
a QMP socket in a private temporary directory, the serial console in a file and
an ``isa-debug-exit`` device (iobase 0xf4) through which a kernel can end QEMU.

Acceleration: with ``accel="auto"`` KVM is tried first when /dev/kvm opens, and
TCG is used when KVM fails to start -- or fails the caller's boot check (some
/dev/kvm implementations, such as software virtualisers without vmx/svm, open
and start but cannot run a kernel).  ``machine.accel`` says which one is in use.

No QEMU outlives its machine: ``close()`` (also run by the context manager, on
every start-up error and at interpreter exit) quits QEMU through QMP and kills
it if it does not go; the child also gets PR_SET_PDEATHSIG so that it dies with
the Python process even on SIGKILL.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ksim.errors import TargetDied, TargetError, TargetTimeout
from ksim.machine.gdbstub import GdbStub, StopReply

QEMU_BINARY = "qemu-system-x86_64"
INSTALL_HINT = "apt-get install qemu-system-x86"

#: the isa-debug-exit port (the toy kernel writes its exit status here)
DEBUG_EXIT_IOBASE = 0xF4

#: -accel/-cpu per accelerator; -cpu host only makes sense under KVM
ACCEL_ARGS: dict[str, tuple[str, ...]] = {
    "kvm": ("-accel", "kvm", "-cpu", "host"),
    "tcg": ("-accel", "tcg", "-cpu", "max"),
}

_LIVE: weakref.WeakSet[QemuMachine] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for machine in list(_LIVE):
        machine.close()


def find_qemu(explicit: str | None = None) -> str:
    """The qemu-system-x86_64 binary: ``explicit``, $KSIM_QEMU, or the PATH."""
    name = explicit or os.environ.get("KSIM_QEMU") or QEMU_BINARY
    path = shutil.which(name)
    if path is None:
        raise TargetError(f"{name} not found: QEMU is needed for the qemu target "
                          f"({INSTALL_HINT})")
    return path


def kvm_usable() -> bool:
    """Whether /dev/kvm can be opened (not whether it can run a kernel)."""
    try:
        fd = os.open("/dev/kvm", os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return False
    os.close(fd)
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _die_with_parent() -> None:
    # prctl(PR_SET_PDEATHSIG, SIGKILL): the kernel kills QEMU when we die
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)


class QemuMachine:
    """A QEMU process.  Use as a context manager, or call close()."""

    def __init__(self, kernel: str | Path | None = None, *, accel: str = "auto",
                 memory: str = "256M", timeout: float = 10.0, qemu: str | None = None,
                 extra_args: Sequence[str] = (),
                 boot_check: Callable[[QemuMachine], None] | None = None) -> None:
        """Start QEMU, stopped at the reset vector, and connect QMP and the gdbstub.

        ``accel``: "auto" (KVM if it works, else TCG), "kvm" or "tcg".
        ``boot_check(machine)`` runs after start-up; if it raises a TargetError
        under KVM, the machine is restarted under TCG (it should leave the guest
        stopped).  Its error under TCG (or a forced accelerator) propagates.
        """
        if accel not in ("auto", "kvm", "tcg"):
            raise ValueError(f"accel must be auto, kvm or tcg, not {accel!r}")
        self.binary = find_qemu(qemu)
        self.kernel = Path(kernel) if kernel is not None else None
        if self.kernel is not None and not self.kernel.is_file():
            raise TargetError(f"kernel image {self.kernel} does not exist")
        self.memory, self.timeout, self.extra_args = memory, timeout, tuple(extra_args)
        self.accel: str | None = None
        #: why each accelerator tried before the one in use was given up
        self.accel_failures: dict[str, str] = {}
        self.proc: subprocess.Popen[bytes] | None = None
        self.gdb: GdbStub | None = None
        self.qmp: Any = None  # qemu.qmp.legacy.QEMUMonitorProtocol once connected
        self.tmpdir = Path(tempfile.mkdtemp(prefix="ksim-qemu-"))
        self.boot_seconds = 0.0
        _LIVE.add(self)
        if accel == "auto":
            candidates = ["kvm", "tcg"] if kvm_usable() else ["tcg"]
            if not kvm_usable():
                self.accel_failures["kvm"] = "/dev/kvm cannot be opened"
        else:
            candidates = [accel]
        try:
            for i, candidate in enumerate(candidates):
                last = i == len(candidates) - 1
                try:
                    self._launch(candidate)
                    if boot_check is not None:
                        boot_check(self)
                    return
                except TargetError as e:
                    if last:
                        raise
                    self.accel_failures[candidate] = str(e)
                    self._shutdown()
        except BaseException:
            self.close()
            raise

    # --- paths ----------------------------------------------------------------
    @property
    def serial_path(self) -> Path:
        return self.tmpdir / "serial.log"

    @property
    def stderr_path(self) -> Path:
        return self.tmpdir / "stderr.log"

    @property
    def qmp_path(self) -> Path:
        return self.tmpdir / "qmp.sock"

    def serial_text(self) -> str:
        try:
            return self.serial_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def stderr_tail(self, lines: int = 15) -> str:
        try:
            text = self.stderr_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(text.strip().splitlines()[-lines:])

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    # --- start-up -------------------------------------------------------------
    def command_line(self, accel: str, gdb_port: int) -> list[str]:
        args = [
            self.binary, "-S",
            "-gdb", f"tcp:127.0.0.1:{gdb_port}",
            "-qmp", f"unix:{self.qmp_path},server,nowait",
            "-display", "none", "-no-reboot", "-nodefaults",
            "-m", self.memory, "-smp", "1",
            "-serial", f"file:{self.serial_path}",
            "-device", f"isa-debug-exit,iobase={DEBUG_EXIT_IOBASE:#x},iosize=0x04",
            *ACCEL_ARGS[accel],
        ]
        if self.kernel is not None:
            args += ["-kernel", str(self.kernel)]
        return args + list(self.extra_args)

    def _launch(self, accel: str) -> None:
        started = time.monotonic()
        for attempt in range(3):
            try:
                self._launch_once(accel)
                break
            except TargetDied:
                # the free port was taken between our probe and QEMU's bind: another port
                if attempt == 2 or "Address already in use" not in self.stderr_tail():
                    raise
                self._shutdown()
        self.boot_seconds = time.monotonic() - started

    def _launch_once(self, accel: str) -> None:
        for path in (self.serial_path, self.qmp_path):
            path.unlink(missing_ok=True)
        port = free_port()
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                self.command_line(accel, port), stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=err, preexec_fn=_die_with_parent)
        self.accel = accel
        self._connect_qmp()
        self.gdb = GdbStub("127.0.0.1", port, timeout=self.timeout,
                           connect_timeout=self.timeout, alive=self.alive)

    def _connect_qmp(self) -> None:
        from qemu.qmp.legacy import QEMUMonitorProtocol

        deadline = time.monotonic() + self.timeout
        while not self.qmp_path.exists():
            self._check_alive("starting")
            if time.monotonic() > deadline:
                raise TargetTimeout(self._describe(f"no QMP socket within {self.timeout:.0f} s"))
            time.sleep(0.02)
        # the socket file appears when QEMU binds it, a moment before it listens:
        # a refused connection is retried until the deadline
        while True:
            qmp = QEMUMonitorProtocol(str(self.qmp_path))
            qmp.settimeout(self.timeout)
            try:
                qmp.connect(negotiate=True)
                break
            except Exception as e:
                self._check_alive("connecting to QMP")
                if time.monotonic() > deadline:
                    raise TargetError(self._describe(f"cannot connect to QMP: {e}")) from e
                with contextlib.suppress(Exception):
                    qmp.close()
                time.sleep(0.02)
        self.qmp = qmp

    # --- liveness ---------------------------------------------------------------
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _describe(self, what: str) -> str:
        tail = self.stderr_tail()
        accel = f" ({self.accel})" if self.accel else ""
        return f"qemu{accel}: {what}" + (f"\n--- qemu stderr ---\n{tail}" if tail else "")

    def _check_alive(self, doing: str) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise TargetDied(self._describe(
                f"exited with status {self.proc.returncode} while {doing}"))

    def wait_exit(self, timeout: float = 2.0) -> int | None:
        """QEMU's exit status, waiting up to ``timeout`` for it to end (None if it does not)."""
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    @property
    def exit_status(self) -> int | None:
        """QEMU's exit status once it has ended (isa-debug-exit: (value << 1) | 1)."""
        return self.proc.poll() if self.proc is not None else None

    # --- QMP control --------------------------------------------------------------
    def qmp_command(self, name: str, **args: object) -> object:
        if self.qmp is None:
            raise TargetDied(self._describe("not running"))
        self._check_alive(f"sending {name}")
        try:
            return self.qmp.cmd(name, **args)
        except Exception as e:
            self._check_alive(f"sending {name}")
            raise TargetError(self._describe(f"QMP {name} failed: {e}")) from e

    def status(self) -> str:
        """QMP query-status: "prelaunch", "running", "paused", "debug", "shutdown"..."""
        reply = self.qmp_command("query-status")
        return str(reply["status"]) if isinstance(reply, dict) else str(reply)

    def cont(self) -> None:
        """Let the guest run.  Resumed through the gdbstub, so that the stub
        reports the next stop (breakpoint, stop(), exit) to us."""
        self._need_gdb().resume()

    def stop(self) -> StopReply:
        """Stop the guest (QMP ``stop``) and return why it stopped: a breakpoint
        hit just before the stop is reported as that breakpoint."""
        gdb = self._need_gdb()
        if not gdb.running:
            return gdb.halt_reason()
        self.qmp_command("stop")
        return gdb.wait()

    def _need_gdb(self) -> GdbStub:
        if self.gdb is None:
            raise TargetDied(self._describe("not running"))
        return self.gdb

    def hmp(self, line: str) -> str:
        return str(self.qmp_command("human-monitor-command", **{"command-line": line}))

    def read_physical(self, address: int, size: int) -> bytes:
        """Guest-physical memory through HMP ``xp`` (works while the guest runs,
        unlike the gdbstub, which needs it stopped)."""
        out = bytearray()
        for line in self.hmp(f"xp /{size}bx {address:#x}").splitlines():
            _, sep, values = line.partition(":")
            if sep:
                out += bytes(int(v, 16) for v in values.split())
        if len(out) != size:
            raise TargetError(self._describe(f"xp at {address:#x}: {len(out)} of {size} bytes"))
        return bytes(out)

    # --- close ----------------------------------------------------------------------
    def _shutdown(self) -> None:
        """End QEMU (QMP quit, then SIGTERM, then SIGKILL) and drop the connections."""
        if self.gdb is not None:
            self.gdb.close()
            self.gdb = None
        if self.qmp is not None:
            if self.alive():
                with contextlib.suppress(Exception):
                    self.qmp.cmd("quit")
            with contextlib.suppress(Exception):
                self.qmp.close()
            self.qmp = None
        proc, self.proc = self.proc, None
        if proc is not None:
            for sig in (None, signal.SIGTERM, signal.SIGKILL):
                if sig is not None:
                    with contextlib.suppress(ProcessLookupError):
                        proc.send_signal(sig)
                try:
                    proc.wait(timeout=2.0)
                    break
                except subprocess.TimeoutExpired:
                    continue
            self.proc_returncode = proc.returncode

    def close(self) -> None:
        self._shutdown()
        shutil.rmtree(self.tmpdir, ignore_errors=True)
        _LIVE.discard(self)

    def __enter__(self) -> QemuMachine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()
