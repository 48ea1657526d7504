"""QemuMachine: one qemu-system-* process, driven through QMP and the gdbstub.

The machine starts QEMU stopped (``-S``) with a gdbstub on a free local TCP port,
a QMP socket in a private temporary directory, the serial console in a file and
a way for the kernel to end QEMU with a status of its choosing.  What differs
between architectures is plain data, a :class:`QemuProfile` in ``PROFILES``:

    x86_64   qemu-system-x86_64 (pc machine); exit through ``isa-debug-exit``
             at port 0xf4 (status (value << 1) | 1)
    aarch64  qemu-system-aarch64 -M virt (cortex-a57, GICv2, PL011 as the
             serial port); exit through Arm semihosting's SYS_EXIT (status =
             the code), handled by QEMU itself (``target=native``: with the
             default ``auto`` an attached gdb would be asked to do it)

Acceleration: with ``accel="auto"`` KVM is tried first when the profile has it
and /dev/kvm opens, and TCG is used when KVM fails to start -- or fails the
caller's boot check (some /dev/kvm implementations, such as software
virtualisers without vmx/svm, open and start but cannot run a kernel).
``machine.accel`` says which one is in use.  The aarch64 profile is TCG only:
KVM runs a guest of the host's own architecture.

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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ksim.arch import get_arch
from ksim.errors import TargetDied, TargetError, TargetTimeout
from ksim.machine.gdbstub import GdbStub, StopReply

#: the isa-debug-exit port (the x86 toy kernel writes its exit status here)
DEBUG_EXIT_IOBASE = 0xF4


@dataclass(frozen=True, slots=True)
class QemuProfile:
    """How QEMU runs one architecture's kernels (plain data; see PROFILES)."""

    arch: str
    binary: str
    #: environment variable that names another binary
    env: str
    install_hint: str
    #: the machine, its exit device and anything else every boot needs
    machine_args: tuple[str, ...]
    #: -accel/-cpu per accelerator, in the order "auto" tries them
    accel_args: Mapping[str, tuple[str, ...]]


PROFILES: dict[str, QemuProfile] = {
    "x86_64": QemuProfile(
        arch="x86_64", binary="qemu-system-x86_64", env="KSIM_QEMU",
        install_hint="apt-get install qemu-system-x86",
        machine_args=("-device", f"isa-debug-exit,iobase={DEBUG_EXIT_IOBASE:#x},iosize=0x04"),
        # -cpu host only makes sense under KVM
        accel_args={"kvm": ("-accel", "kvm", "-cpu", "host"),
                    "tcg": ("-accel", "tcg", "-cpu", "max")}),
    "aarch64": QemuProfile(
        arch="aarch64", binary="qemu-system-aarch64", env="KSIM_QEMU_AARCH64",
        install_hint="apt-get install qemu-system-arm",
        machine_args=("-M", "virt", "-semihosting-config", "enable=on,target=native"),
        # the CPU unicorn's arm64 target models (UC_CPU_ARM64_A57)
        accel_args={"tcg": ("-accel", "tcg", "-cpu", "cortex-a57")}),
}


def profile(arch: str) -> QemuProfile:
    """The QEMU profile for kernels of ``arch`` (TargetError if there is none)."""
    try:
        return PROFILES[arch]
    except KeyError:
        raise TargetError(f"no QEMU profile for {arch} kernels (known: "
                          f"{', '.join(sorted(PROFILES))})") from None

_LIVE: weakref.WeakSet[QemuMachine] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for machine in list(_LIVE):
        machine.close()


def find_qemu(explicit: str | None = None, arch: str = "x86_64") -> str:
    """The QEMU binary for ``arch``: ``explicit``, the profile's environment
    variable ($KSIM_QEMU for x86_64), or the profile's binary on the PATH."""
    prof = profile(arch)
    name = explicit or os.environ.get(prof.env) or prof.binary
    path = shutil.which(name)
    if path is None:
        raise TargetError(f"{name} not found: QEMU is needed for the qemu target "
                          f"({prof.install_hint})")
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
                 extra_args: Sequence[str] = (), arch: str = "x86_64",
                 boot_check: Callable[[QemuMachine], None] | None = None) -> None:
        """Start QEMU, stopped at the reset vector, and connect QMP and the gdbstub.

        ``arch`` picks the QEMU profile (PROFILES).
        ``accel``: "auto" (KVM if it works, else TCG), "kvm" or "tcg".
        ``boot_check(machine)`` runs after start-up; if it raises a TargetError
        under KVM, the machine is restarted under TCG (it should leave the guest
        stopped).  Its error under TCG (or a forced accelerator) propagates.
        """
        if accel not in ("auto", "kvm", "tcg"):
            raise ValueError(f"accel must be auto, kvm or tcg, not {accel!r}")
        self.profile = profile(arch)
        if accel != "auto" and accel not in self.profile.accel_args:
            raise TargetError(f"{self.profile.binary} runs {arch} kernels under "
                              f"{' or '.join(self.profile.accel_args)} here, not {accel}")
        self.binary = find_qemu(qemu, arch)
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
            candidates = list(self.profile.accel_args)
            if "kvm" in candidates and not kvm_usable():
                candidates.remove("kvm")
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
            *self.profile.machine_args,
            *self.profile.accel_args[accel],
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
        # the register file as the stub lays it out, and the program counter as
        # the Arch names it (gdb and capstone name it alike)
        arch = get_arch(self.profile.arch)
        self.gdb = GdbStub("127.0.0.1", port, timeout=self.timeout,
                           connect_timeout=self.timeout, alive=self.alive,
                           xml_arch=arch.gdb.xml_arch, registers=arch.gdb.layout,
                           pc=arch.pc_reg)

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
        """QEMU's exit status once it has ended (isa-debug-exit: (value << 1) | 1;
        semihosting SYS_EXIT: the code)."""
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
