"""Run options: every target refuses an option it does not take and an impossible
value, before anything runs, and honours its timeout; so does ``ksim count``.

Real unicorn; the live target talks to kerninstd's own server running in this
process (its ``exec`` needs no kernel: it runs a shell command here).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import threading
import time
from typing import Any

import pytest

from ksim.cli import main
from ksim.commands.count import count
from ksim.errors import BadRunValue, TargetTimeout, UnknownOracle, UnknownRunOption
from ksim.kapi import Manager
from ksim.live import abi, daemon
from ksim.live.client import LiveTarget
from ksim.live.device import ModuleState
from ksim.targets.base import run_option_names, run_options
from ksim.targets.qemu import QemuTarget
from ksim.targets.unicorn import UnicornTarget


@pytest.fixture(scope="module")
def m(toy_path):
    manager = Manager.attach("unicorn:toy")
    yield manager
    manager.detach()


# --- unknown options -------------------------------------------------------------------
def test_a_misspelt_option_is_named_with_the_one_meant(m):
    with pytest.raises(UnknownRunOption, match=r"no option 'iteration' \(did you mean "
                                               r"'iterations'\?\)") as info:
        m.run(iteration=10)
    assert info.value.option == "iteration"
    assert isinstance(info.value, TypeError)  # what Python itself would have raised


def test_another_targets_option_is_refused(m):
    with pytest.raises(UnknownRunOption, match="while_cmd"):
        m.run(while_cmd="true")


@pytest.mark.parametrize("target", [UnicornTarget, QemuTarget, LiveTarget])
def test_every_target_names_its_options(target):
    options = run_option_names(target)
    assert {"progress", "timeout"} <= set(options), options


def test_a_catch_all_is_refused_where_a_run_is_declared():
    with pytest.raises(TypeError, match="no catch-all"):
        @run_options
        def run(self: Any, *, seed: int | None = None, **rest: Any) -> None: ...


# --- impossible values -------------------------------------------------------------------
@pytest.mark.parametrize("options, option", [
    ({"iterations": -5}, "iterations"),
    ({"iterations": 2.5}, "iterations"),
    ({"iterations": "100"}, "iterations"),
    ({"seed": 1 << 64}, "seed"),
    ({"bench_calls": -1}, "bench_calls"),
    ({"timeout": 0}, "timeout"),
    ({"timeout": -1.0}, "timeout"),
    ({"timeout": float("inf")}, "timeout"),
    ({"timeout": True}, "timeout"),
    ({"progress": 42}, "progress"),
    ({"count_instructions": "yes"}, "count_instructions"),
    ({"slices": [100, 0]}, "slices"),
])
def test_an_impossible_value_is_refused(m, options, option):
    with pytest.raises(BadRunValue, match=option):
        m.run(**{"iterations": 20, **options})
    assert m.run(iterations=20).checksum  # and the target still runs


# --- timeouts ----------------------------------------------------------------------------
@pytest.mark.parametrize("sliced", [False, True], ids=["whole", "sliced"])
def test_unicorn_honours_the_timeout(m, sliced):
    start = time.monotonic()
    with pytest.raises(TargetTimeout, match="no halt after"):
        m.run(iterations=10**12, timeout=0.5, progress=(lambda: None) if sliced else None)
    assert time.monotonic() - start < 0.5 + 1.0


TOKEN = b"t" * 32
LAYOUT = {
    "version": abi.ABI_VERSION,
    "text_start": 0xFFFFFFFF81000000, "text_end": 0xFFFFFFFF82000000,
    "code_start": 0xFFFFFFFFC0000000, "code_size": 1 << 20,
    "data_start": 0xFFFFFFFFC0200000, "data_size": 1 << 20,
    "current_task": 0x1AD00, "task_pid_offset": 0x5C8, "task_pid_size": 4,
    "task_tgid_offset": 0x5CC, "task_comm_offset": 0x7A0,
    "cpu_number": 0x1AD08,
}


class TextlessDevice:
    """Stands where /dev/kerninst would: it answers what attaching asks (the
    layout, symbol lookups) and fails on anything that would touch text."""

    def info(self) -> dict[str, int]:
        return dict(LAYOUT)

    def lookup(self, name: str) -> int:
        return 0xFFFFFFFF81000000

    def state(self) -> ModuleState:
        return ModuleState(owners=(), splices=(), routes=(), blocks=())

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise RuntimeError(f"the device was used: {name}")


@pytest.fixture
def live(tmp_path):
    kerninstd = daemon.Daemon(TextlessDevice(), TOKEN, allow_exec=True)  # type: ignore[arg-type]
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="kerninstd", daemon=True)
    thread.start()
    server = asyncio.run_coroutine_threadsafe(
        daemon.start(kerninstd, "127.0.0.1", 0), loop).result(10)
    token = tmp_path / "token"
    fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, TOKEN)
    os.close(fd)
    target = LiveTarget("127.0.0.1", int(server.sockets[0].getsockname()[1]),
                        token_file=str(token), timeout=10.0)
    yield target
    target.close()
    server.close()
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


def test_live_honours_the_timeout_and_refuses_emulator_options(live):
    assert live.run(while_cmd="echo ran").output == "ran\n"
    start = time.monotonic()
    with pytest.raises(TargetTimeout, match="still running after 0.5 s"):
        live.run(while_cmd="sleep 10", timeout=0.5)
    assert time.monotonic() - start < 0.5 + 3.0
    with pytest.raises(UnknownRunOption, match="'seed'"):
        live.run(while_cmd="true", seed=1)
    with pytest.raises(BadRunValue, match="timeout"):
        live.run(while_cmd="true", timeout=-1)
    with pytest.raises(BadRunValue, match="while_cmd"):
        live.run(while_cmd=["true"])
    assert live.run(while_cmd="echo again").output == "again\n"  # the connection is fine


# --- the command line --------------------------------------------------------------------
@pytest.mark.parametrize("args, message", [
    (["--iterations", "-5"], "argument --iterations: must be from 0 to 2**64-1, not -5"),
    (["--iterations", "many"], "argument --iterations: 'many' is not a whole number"),
    (["--seed", "-1"], "argument --seed: must be from 0"),
    (["--oracle", "bogus"], "argument --oracle: invalid choice: 'bogus'"),
])
def test_count_refuses_impossible_arguments(capsys, args, message):
    with pytest.raises(SystemExit) as info:
        main(["count", "fib", *args])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def json_error(capsys, *args: str) -> tuple[int, dict[str, Any]]:
    status = main(["count", "fib", "--iterations", "200", *args, "--json"])
    return status, json.loads(capsys.readouterr().out)


def test_count_refuses_an_oracle_the_target_does_not_have(capsys, toy_path):
    status, out = json_error(capsys, "--oracle", "kprobe")
    assert status == 2 and out["error"] == "unknown-oracle"
    assert "unicorn:toy has no kprobe oracle" in out["message"]
    status, out = json_error(capsys, "--oracle", "unicorn-address-hook")
    assert status == 0 and out["count"] == out["oracle"] > 0


def test_count_refuses_another_targets_option(capsys, toy_path):
    status, out = json_error(capsys, "--while", "true")
    assert status == 2 and out["error"] == "unknown-run-option" and "while_cmd" in out["message"]


def test_count_function_refuses_an_unknown_oracle(toy_path):
    with pytest.raises(UnknownOracle, match="'bogus'"):
        count("fib", "unicorn:toy", oracle="bogus")


# --- QEMU (slow) -------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None, reason="needs qemu-system-x86_64")
def test_qemu_refuses_what_it_cannot_do_and_stops_on_ctrl_c(toy_path):
    with Manager.attach("qemu:toy") as q:
        with pytest.raises(UnknownRunOption, match=r"'iteration' \(did you mean 'iterations'"):
            q.run(iteration=5)
        with pytest.raises(BadRunValue, match="cannot count instructions"):
            q.run(iterations=5, count_instructions=True)
        with pytest.raises(BadRunValue, match="timeout"):
            q.run(iterations=5, timeout=-1)
        fn = q.find_function("fib")
        original = q.target.read(fn.address, 16)
        counter = q.malloc(8)
        handle = q.insert_snippet(q.entry_point(fn), counter.atomic_assign(counter + 1))
        timer = threading.Timer(2.0, os.kill, (os.getpid(), signal.SIGINT))
        start = time.monotonic()
        timer.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                q.run(iterations=10**12, timeout=120)
        finally:
            timer.cancel()
        assert time.monotonic() - start < 2.0 + 2.0
        assert q.target.machine.status() != "running"
        assert q.read(counter) > 0
        q.remove_snippet(handle)  # the guest is stopped: its text can change
        assert q.target.read(fn.address, 16) == original
        with pytest.raises(TargetTimeout, match="did not reach ksim_halt within 1 s"):
            q.run(iterations=10**12, timeout=1.0)
