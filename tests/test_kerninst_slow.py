"""Probes, timers and replacement on the slow targets: the toy kernel under QEMU
(TCG), and the Debian 6.1 kernel of the Linux testbed.  Snippet handlers only:
Python handlers need the in-process trap dispatch of unicorn."""

from __future__ import annotations

import shutil

import pytest

from ksim.errors import HandlerUnsupported, NoReturnPoint
from ksim.kapi import Manager
from ksim.probes import KProbe, KretProbe, Probes
from ksim.snippets import retval
from tests.test_examples_kernel import run_example

try:  # the live fixtures, when the live package is importable
    from ksim.live.testing import getppid_loop, target, testbed  # noqa: F401
except ImportError:  # pragma: no cover
    pass

qemu = pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None,
                          reason="qemu-system-x86_64 is not installed")


@pytest.mark.slow
@qemu
@pytest.mark.parametrize("example, args", [
    ("kprobe_count.py", ["300"]),
    ("jprobe_args.py", ["300"]),
    ("time_func.py", ["fib", "300"]),
    ("replace_function.py", ["300"]),
    ("replace_function_call.py", ["300"]),
])
def test_examples_on_qemu(toy_path, example, args):
    run_example(example, "qemu:toy", *args)


@pytest.mark.slow
@pytest.mark.parametrize("image", [
    pytest.param("toy", marks=qemu),
    pytest.param("toy-arm64", marks=pytest.mark.skipif(
        shutil.which("qemu-system-aarch64") is None,
        reason="qemu-system-aarch64 is not installed")),
])
def test_probes_on_qemu_match_unicorn(toy_path, image):
    def counts(spec: str) -> tuple[int, int, int]:
        with Manager.attach(spec) as m:
            probes = Probes(m)
            total = m.malloc()
            kp = KProbe("submit_bio", pre_handler=total.atomic_assign(total + 1))
            rp = KretProbe("tcp_sync_mss", handler=total.atomic_assign(total + retval()))
            probes.register_kprobe(kp)
            probes.register_kretprobe(rp)
            m.run(iterations=300)
            out = (kp.nhit, rp.nhit, m.read(total))
            probes.unregister_kprobe(kp)
            probes.unregister_kretprobe(rp)
            return out

    assert counts(f"qemu:{image}") == counts(f"unicorn:{image}")


@pytest.mark.slow
@qemu
def test_python_handlers_are_refused_on_qemu(toy_path):
    with Manager.attach("qemu:toy") as m:
        with pytest.raises(HandlerUnsupported):
            Probes(m).register_kprobe(KProbe("submit_bio", pre_handler=lambda k, r: None))
        assert m.splices() == {}


@pytest.mark.slow
@pytest.mark.live
def test_kprobe_and_kretprobe_on_linux(target):  # noqa: F811 - ksim.live.testing's fixture
    m = Manager(target)
    probes = Probes(m)
    kp = KProbe("__x64_sys_getppid", pre_handler=None)
    rp = KretProbe("__x64_sys_getppid", handler=None)
    counter = m.malloc()
    kp.pre_handler = counter.atomic_assign(counter + 1)
    rp.handler = counter.atomic_assign(counter + 1)
    probes.register_kprobe(kp)
    try:
        probes.register_kretprobe(rp)
    except NoReturnPoint:
        rp = None  # a tail-calling build of the syscall: entry probe only
    m.run(while_cmd=f"{getppid_loop()} 1000")
    assert kp.nhit >= 1000
    if rp is not None:
        assert rp.nhit >= 1000
        probes.unregister_kretprobe(rp)
    probes.unregister_kprobe(kp)
    assert m.splices() == {}
