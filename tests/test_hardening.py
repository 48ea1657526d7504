"""Bad input ends in a specific ksim error and changes nothing (issue "Hardening,
round two"): the relocator's calls, the Manager's arguments, the verifier's call
allow-list, ELF loading, the ``ksim count`` point grammar and token files.

The fuzz tests are bounded: a few hundred examples, each under a time limit
(SIGALRM), so that a hang fails the test instead of stalling the suite."""

from __future__ import annotations

import fnmatch
import json
import signal
import struct
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_daemon_hardening import LAYOUT, Running

from ksim.arch import get_arch
from ksim.errors import (
    BadArgument,
    BadOperand,
    CallInsideRun,
    CallNotAllowed,
    DuplicateHandle,
    ImageError,
    KeptNameTaken,
    KsimError,
    MalformedImage,
    PointSyntaxError,
    TokenFileError,
    UnknownPolicy,
    WriteOutsideHeap,
)
from ksim.kapi import Manager
from ksim.snippets import ast


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Fail with TimeoutError if the body runs longer than ``seconds``."""
    def expired(_signum: int, _frame: object) -> None:
        raise TimeoutError(f"took more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def state(m):
    """What a refusal must leave as it was: text, trap routes, heap and patch
    allocations, splices."""
    t = m.target
    return (m.text_snapshot(), dict(t._traps), t._code.allocated(), t._data.allocated(),
            m.splices())


# --- 1. the relocator: a call is never moved as a plain call --------------------------------------
X86_OLD, X86_NEW = 0xFFFFFFFF81000000, 0xFFFFFFFFA0000000


def _x86(code: bytes, at: int = X86_OLD):
    return list(get_arch("x86_64").decode(code, at))


def test_relocate_moves_a_last_call_with_its_original_return_address():
    arch = get_arch("x86_64")
    for code in (bytes([0xE8, 0x00, 0x10, 0x00, 0x00]),          # call rel32
                 bytes([0xFF, 0xD0]),                            # call rax
                 bytes([0xFF, 0x15, 0x10, 0x00, 0x00, 0x00])):   # call [rip+0x10]
        insn = _x86(code)[0]
        out = arch.relocate([insn], X86_NEW)
        assert out == arch.moved_call(insn, X86_NEW)
        end = insn.end.to_bytes(8, "little")[:4]
        if code[:2] == b"\xff\x15":     # through memory: push [mem]; push [rsp]; then
            assert out[-10:] == b"\x48\xc7\x44\x24\x08" + end + b"\xc3"  # mov [rsp+8], end; ret
        else:
            assert out[:5] == b"\x68" + end                                 # push original end


def test_relocate_turns_call_to_next_into_a_push_and_refuses_calls_inside_a_run():
    arch = get_arch("x86_64")
    assert arch.relocate(_x86(bytes([0xE8, 0, 0, 0, 0, 0x59])), X86_NEW) == (
        b"\x68" + (X86_OLD + 5).to_bytes(8, "little")[:4] + b"\x59")
    with pytest.raises(CallInsideRun):
        arch.relocate(_x86(bytes([0xFF, 0xD0, 0x90])), X86_NEW)          # call rax; nop


def test_aarch64_relocate_leaves_the_original_return_address_in_x30():
    arch = get_arch("aarch64")
    old, new = 0xFFFF800010000000, 0xFFFF800010040000
    bl = (0x94000000 | 0x40).to_bytes(4, "little")                       # bl .+0x100
    insn = list(arch.decode(bl, old))[0]
    assert arch.relocate([insn], new) == arch.moved_call(insn, new)
    nop = (0xD503201F).to_bytes(4, "little")
    with pytest.raises(CallInsideRun):
        arch.relocate(list(arch.decode(bl + nop, old)), new)


@pytest.mark.parametrize("name,code,old,new", [
    ("x86_64", bytes([0xE8, 0x00, 0x10, 0x00, 0x00]), X86_OLD, X86_NEW),
    ("aarch64", (0x94000040).to_bytes(4, "little"), 0xFFFF800010000000, 0xFFFF800010040000),
])
def test_relocate_and_moved_call_refuse_what_is_no_instruction_or_address(name, code, old, new):
    """A BadArgument, not a TypeError or AttributeError; and an address past 64 bits
    or below 0 is refused (the x86-64 relocator encoded a call at -1 as at 0)."""
    arch = get_arch(name)
    insns = list(arch.decode(code, old))
    for bad in (None, [1], "x", [None], 5):
        with pytest.raises(BadArgument, match="sequence of Insn"):
            arch.relocate(bad, new)
    for bad in (1, None, "x"):
        with pytest.raises(BadArgument, match="sequence of Insn"):
            arch.moved_call(bad, new)
    for address in (-1, 1 << 64, "x", None, 1.0, True):
        with pytest.raises(BadArgument, match="from 0 to 2\\*\\*64-1"):
            arch.relocate(insns, address)
        with pytest.raises(BadArgument, match="from 0 to 2\\*\\*64-1"):
            arch.moved_call(insns[0], address)
        if address is not None:
            with pytest.raises(BadArgument, match="first_to"):
                arch.relocate(insns, new, first_to=address)
    assert arch.relocate(insns, new) == arch.moved_call(insns[0], new)


# --- 2. the Manager's arguments ----------------------------------------------------------------
@pytest.fixture
def m(toy_manager):
    yield toy_manager
    assert not toy_manager.splices(), "a test left a splice behind"


def test_remove_many_refuses_a_duplicate_before_removing_anything(m):
    f = m.find_function("tcp_sync_mss")
    hs = [m.insert_snippet(m.entry_point(f), ast.Seq(())),
          m.insert_snippet(m.exit_points(f)[0], ast.Seq(()))]
    before = state(m)
    with pytest.raises(DuplicateHandle, match="named twice"):
        m.remove_many(hs + hs[:1])
    assert state(m) == before
    with pytest.raises(BadArgument):
        m.remove_many(hs + [None])
    assert state(m) == before
    m.remove_many(hs)


@pytest.mark.parametrize("call", [
    lambda m: m.point_at("abc"),
    lambda m: m.point_at(None),
    lambda m: m.point_at(1.5),
    lambda m: m.point_at(True),
    lambda m: m.malloc(0),
    lambda m: m.malloc(-8),
    lambda m: m.malloc(3),
    lambda m: m.malloc("8"),
    lambda m: m.malloc_array(-1),
    lambda m: m.malloc_array(2, 16),
    lambda m: m.alloc_data(0),
    lambda m: m.alloc_data(8, 3),
    lambda m: m.insert_many([None], ast.Seq(())),
    lambda m: m.insert_many(5, ast.Seq(())),
    lambda m: m.insert_many("tcp_sync_mss", ast.Seq(())),
    lambda m: m.insert_snippet(None, ast.Seq(())),
    lambda m: m.remove_snippet(None),
    lambda m: m.remove_many([7]),
    lambda m: m.free("x"),
    lambda m: m.free(ast.Var(ast.Arg(0))),
    lambda m: m.read(ast.Var(ast.Arg(0))),
    lambda m: m.read(5),
    lambda m: m.write(ast.Var("x"), 1),
    lambda m: m.read_array([ast.Var("x")]),
    lambda m: m.find_function(5),
    lambda m: m.entry_point(None),
    lambda m: m.allow_calls(True),
    lambda m: m.allow_calls(1.5),
    lambda m: m.divert(m.entry_point("tcp_sync_mss"), "x"),
    lambda m: m.reserve_code(0),
    lambda m: m.reserve_code(-1),
    lambda m: m.reserve_code(64, near="x"),
    lambda m: m.patch_of(None),
    lambda m: m.release_code(None),
    lambda m: m.fill_code(None, 0, b"\xc3"),
], ids=lambda _: "")
def test_bad_arguments_are_bad_argument_errors_and_change_nothing(m, call):
    before = state(m)
    with pytest.raises(BadArgument) as info:
        call(m)
    assert "must" in str(info.value) or "expected" in str(info.value) or "named" in str(info.value)
    assert state(m) == before


def test_fill_code_writes_only_inside_its_block(m):
    """Code given to fill_code lies inside the block reserve_code gave: kernel text,
    another block or the bytes after the block are refused, and nothing is written."""
    block = m.reserve_code(64)
    entry = m.entry_point("tcp_sync_mss").address
    before = state(m)
    for base, code in ((entry, b"\xcc" * 4), (block.block + 62, b"\x90" * 4),
                       (block.block - 1, b"\x90" * 2), (block.block, b""),
                       (block.block, "\xc3")):
        with pytest.raises(BadArgument):
            m.fill_code(block, base, code)
        assert state(m) == before
    m.fill_code(block, block.block + 60, b"\xc3" * 4)
    assert m.target.read(block.block + 60, 4) == b"\xc3" * 4
    m.release_code(block)


def test_a_detached_manager_refuses_to_be_used(toy_path):
    """After detach every use of the target is Detached (it kept working on the
    emulators); detaching again does nothing."""
    from ksim.errors import Detached

    mgr = Manager.attach("unicorn:toy")
    point = mgr.entry_point("tcp_sync_mss")
    mgr.detach()
    for call in (lambda: mgr.malloc(), lambda: mgr.insert_snippet(point, ast.Seq(())),
                 lambda: mgr.run(iterations=1), lambda: mgr.reserve_code(16)):
        with pytest.raises(Detached, match="detached"):
            call()
    mgr.detach()


@pytest.mark.parametrize("address", [ast.Arg(0), "x", 1.5, True, -8, 1 << 64])
def test_a_var_made_of_a_non_address_is_a_bad_operand(m, address):
    counter = m.malloc()
    before = state(m)
    point = m.entry_point("tcp_sync_mss")
    for snippet in (ast.Var(address).assign(1), counter.assign(ast.Var(address))):
        with pytest.raises(BadOperand, match="not a 64-bit address"):
            m.insert_snippet(point, snippet)
    with pytest.raises(WriteOutsideHeap, match="miss counter"):
        m.insert_snippet(point, ast.Seq(()), missed=ast.Var(address))
    assert state(m) == before
    m.free(counter)


@pytest.mark.parametrize("policy", ["bogus", "", None, 3, ["jmp"]])
def test_an_unknown_policy_names_the_policies_and_changes_nothing(m, policy):
    point = m.entry_point("tcp_sync_mss")
    before = state(m)
    for call in (lambda: m.insert_snippet(point, ast.Seq(()), splice=policy),
                 lambda: m.insert_many([point], ast.Seq(()), splice=policy),
                 lambda: m.divert(point, m.find_function("tcp_current_mss").address,
                                  splice=policy)):
        with pytest.raises(UnknownPolicy, match="the policies are jmp, trap, auto"):
            call()
    assert "the policies are" in (m.can_insert(point, policy) or "")
    assert state(m) == before


def test_malloc_array_of_none_takes_no_block(m):
    before = state(m)
    assert m.malloc_array(0) == []
    assert state(m) == before


# --- 3. the verifier's call allow-list takes exactly ints -------------------------------------------
class _Liar(int):
    def __eq__(self, other: object) -> bool:
        return True

    def __ne__(self, other: object) -> bool:
        return False

    def __hash__(self) -> int:
        return hash(self.allowed)

    allowed = 0


def test_a_snippet_calling_an_int_subclass_is_refused_by_the_manager(m):
    callee = m.find_function("tcp_current_mss").address
    m.allow_calls(callee)
    _Liar.allowed = callee
    counter = m.malloc()
    before = state(m)
    for address in (_Liar(m.find_function("tcp_sync_mss").address), True):
        with pytest.raises(CallNotAllowed, match="plain int"):
            m.insert_snippet(m.entry_point("vfs_read"), counter.assign(ast.call(address)))
    assert state(m) == before
    m.free(counter)


# --- 6. token files, and keeping under a name that is taken -------------------------------------------
def test_cached_kallsyms_files_are_pruned_to_the_most_recently_used(tmp_path):
    """prune_kallsyms: the kallsyms files of a cache directory (one per kernel identity)
    beyond the most recently used are removed with their parsed copies; the one in use
    stays whatever its age; other files are not touched."""
    import os

    from ksim.image.kallsyms import kept_path
    from ksim.live.client import prune_kallsyms

    files = []
    for age in range(6):
        path = tmp_path / f"kallsyms-k-{age}.txt"
        path.write_text("ffffffff81000000 T _stext\n")
        kept_path(path).write_bytes(b"columns")
        os.utime(path, (1_000_000 - age, 1_000_000 - age))
        files.append(path)
    other = tmp_path / "kernel.json"
    other.write_text("{}")
    in_use = files[-1]          # the oldest, but the one this target uses
    removed = prune_kallsyms(in_use, most=3)
    assert sorted(removed) == sorted(files[2:5])
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted([other.name, *(p.name for p in (*files[:2], in_use)),
                           *(kept_path(p).name for p in (*files[:2], in_use))])
    assert prune_kallsyms(in_use, most=3) == []


def test_read_token_names_what_is_wrong_with_the_file(tmp_path):
    from ksim.live.client import MAX_TOKEN_BYTES, read_token

    with pytest.raises(TokenFileError, match="no such file"):
        read_token(str(tmp_path / "absent"))
    with pytest.raises(TokenFileError, match="is a directory"):
        read_token(str(tmp_path))
    (tmp_path / "blank").write_text(" \n")
    with pytest.raises(TokenFileError, match="is empty"):
        read_token(str(tmp_path / "blank"))
    (tmp_path / "big").write_bytes(b"k" * (MAX_TOKEN_BYTES + 1))
    with pytest.raises(TokenFileError, match="more than"):
        read_token(str(tmp_path / "big"))
    if Path("/dev/zero").exists():
        with time_limit(10), pytest.raises(TokenFileError, match="more than"):
            read_token("/dev/zero")
    (tmp_path / "token").write_text("ab" * 16 + "\n")
    assert read_token(str(tmp_path / "token")) == b"ab" * 16


def _cli(argv: list[str], capsys) -> tuple[int, str, str]:
    from ksim.cli import main

    status = main(argv)
    out, err = capsys.readouterr()
    return status, out, err


@pytest.mark.parametrize("command", ["kept", "count"])
@pytest.mark.parametrize("token", ["absent", "directory"])
def test_a_bad_token_file_is_a_token_file_error_on_the_command_line(
        tmp_path, monkeypatch, capsys, command, token):
    """No traceback: the error printed, exit status 2, a JSON error record with --json;
    and nothing sent (the port is one nothing listens on)."""
    path = tmp_path / "token"
    if token == "directory":
        path.mkdir()
    monkeypatch.setenv("KSIM_TESTBED_DIR", str(tmp_path))       # the default token file
    argv = ({"kept": ["kept", "--token-file", str(path)], "count": ["count", "tcp_sync_mss"]}
            [command] + ["--target", "live://127.0.0.1:1"])
    status, out, err = _cli(argv, capsys)
    assert status == 2 and not out
    assert err.startswith("ksim: error: token file") and "Traceback" not in err
    status, out, _ = _cli(argv + ["--json"], capsys)
    assert status == 2 and json.loads(out)["error"] == "token-file"


def test_a_live_target_whose_port_is_no_number_is_refused(capsys):
    status, _, err = _cli(["kept", "--target", "live://127.0.0.1:²"], capsys)
    assert status == 2 and "expected HOST:PORT" in err


class _KeepingDevice:
    """The kernel module's owners as far as ``keep`` uses them: one owner per kept name
    (kmod/kerninst.c, ki_owner_keep: EEXIST when another owner has it), refused as
    /dev/kerninst's ioctl refuses (ksim.live.device), through ksim.live.abi's table."""

    def __init__(self) -> None:
        from ksim.live.device import ModuleState

        self.names: dict[int, str] = {}
        self.owners = 0
        self.log = ModuleState((), (), (), ())

    def info(self) -> dict[str, int]:
        return dict(LAYOUT)

    def state(self):
        return self.log

    def owner_new(self) -> int:
        self.owners += 1
        return self.owners

    def owner_keep(self, owner: int, name: str) -> None:
        import errno
        import os

        from ksim.live import abi
        from ksim.live.protocol import make_error

        if name and any(n == name and o != owner for o, n in self.names.items()):
            raise make_error(abi.error_code("OWNER_KEEP", errno.EEXIST),
                             f"kerninst owner_keep: {os.strerror(errno.EEXIST)}")
        self.names[owner] = name

    def owner_drop(self, owner: int) -> None:
        self.names.pop(owner, None)


@pytest.fixture
def kerninstd() -> Iterator[Running]:
    """kerninstd's own server in this process (tests/test_daemon_hardening.py), its
    device the module's owners as keep uses them."""
    from ksim.live import daemon

    running = Running(daemon.Limits())
    running.daemon.device = running.device = _KeepingDevice()  # type: ignore[assignment]
    yield running
    running.close()


def test_keeping_under_a_name_already_kept_is_kept_name_taken(kerninstd):
    from ksim.live.client import request_keep

    with kerninstd.connect() as first, kerninstd.connect() as second:
        assert request_keep(first, True, "counter") == "counter"
        with pytest.raises(KeptNameTaken, match="already kept under the name 'counter'"):
            request_keep(second, True, "counter")
        assert kerninstd.device.names == {1: "counter"}            # nothing changed
        assert request_keep(second, True, "counter-2") == "counter-2"
        assert kerninstd.device.names == {1: "counter", 2: "counter-2"}


# --- 4. ELF loading: a corrupt or impossible ELF is an ImageError -------------------------------------
_EHDR = struct.Struct("<16sHHIQQQIHHHHHH")
_SHDR = struct.Struct("<IIQQQQIIQQ")


def _elf_regions(data: bytes) -> list[tuple[int, int]]:
    """Where corruption says most: the ELF header, the section header table, and
    the first bytes of the symbol, string and relocation tables."""
    fields = _EHDR.unpack_from(data)
    shoff, shnum = fields[6], fields[12]
    regions = [(0, _EHDR.size), (shoff, shnum * _SHDR.size)]
    for i in range(shnum):
        sh = _SHDR.unpack_from(data, shoff + i * _SHDR.size)
        if sh[1] in (2, 3, 4, 7):                     # SYMTAB, STRTAB, RELA, NOTE
            regions.append((sh[4], min(sh[5], 4096)))
    return [(at, size) for at, size in regions if size > 0]


@pytest.fixture(scope="module", params=["vmlinux", "module"])
def real_elf(request, toy_path) -> tuple[bytes, list[tuple[int, int]]]:
    """The toy kernel (ET_EXEC), or one of the objects it is linked from (ET_REL,
    loaded as a module is)."""
    path = Path(toy_path)
    if request.param == "module":
        path = path.parent / "obj" / "kernel" / "sched.o"
        if not path.is_file():
            pytest.skip("the toy's objects are not kept")
    data = path.read_bytes()
    return data, _elf_regions(data)


def _load_and_use(data: bytes) -> None:
    """Load ``data`` and use the image as the analysis does first."""
    from ksim.analysis import store
    from ksim.image.elf import load_image_bytes

    image = load_image_bytes(data, "<corrupt>")
    store.image_key(image)
    for f in image.functions[:3]:
        image.function_at(f.address)
        image.read(f.address, min(f.size, 64))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_corrupt_elf_is_an_image_error_or_loads(real_elf, data):
    original, regions = real_elf
    buf = bytearray(original)
    for _ in range(data.draw(st.integers(1, 4), label="edits")):
        if data.draw(st.booleans(), label="in a table"):
            start, size = data.draw(st.sampled_from(regions), label="region")
            at = start + data.draw(st.integers(0, size - 1), label="offset")
        else:
            at = data.draw(st.integers(0, len(buf) - 1), label="offset")
        value = data.draw(st.one_of(
            st.binary(min_size=1, max_size=8),
            st.sampled_from([b"\xff" * 8, b"\x00" * 8, b"\xff\xff\xff\x7f", b"\x00\x00\x00\x80",
                             b"\x01", b"\x40"])), label="bytes")
        buf[at:at + len(value)] = value
    if data.draw(st.integers(0, 9), label="truncate?") == 0:
        del buf[data.draw(st.integers(0, len(buf) - 1), label="length"):]
    with time_limit(30):
        try:
            _load_and_use(bytes(buf))
        except ImageError:
            pass


def test_a_relocatable_object_past_the_top_of_the_address_space_is_refused(tmp_path):
    """An ET_REL whose sections, laid out from the module area, pass 2**64 (a 2 GiB
    .bss before a function): refused by the loader, not an OverflowError of the
    analysis store."""
    from ksim.image.elf import load_image

    src = tmp_path / "big.s"
    src.write_text('\t.section .bss.big,"aw",@nobits\n\t.globl big\nbig:\t.zero 0x80000000\n'
                   '\t.section .text.f,"ax",@progbits\n\t.globl f\n\t.type f,@function\n'
                   'f:\tret\n\t.size f, .-f\n')
    obj = tmp_path / "big.o"
    try:
        subprocess.run(["as", "--64", "-o", str(obj), str(src)], check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("no x86-64 assembler")
    with pytest.raises(MalformedImage, match="top of the address space"):
        load_image(obj)


@pytest.mark.parametrize("edit", ["section address", "symbol size"])
def test_an_elf_reaching_past_the_top_of_the_address_space_is_refused(toy_path, edit):
    from ksim.image.elf import load_image_bytes

    data = bytearray(Path(toy_path).read_bytes())
    fields = _EHDR.unpack_from(data)
    shoff, shnum = fields[6], fields[12]
    headers = [_SHDR.unpack_from(data, shoff + i * _SHDR.size) for i in range(shnum)]
    if edit == "section address":
        text = next(i for i, h in enumerate(headers) if h[2] & 4)   # SHF_EXECINSTR
        struct.pack_into("<Q", data, shoff + text * _SHDR.size + 16, (1 << 64) - 0x100)
    else:
        symtab = next(h for h in headers if h[1] == 2)
        at = next(symtab[4] + k for k in range(0, symtab[5], 24)
                  if data[symtab[4] + k + 4] & 0xF == 2)             # the first STT_FUNC
        struct.pack_into("<Q", data, at + 16, (1 << 64) - 1)        # st_size
    with pytest.raises(MalformedImage, match="top of the address space"):
        load_image_bytes(bytes(data))


# --- 5. the ``ksim count`` point grammar ----------------------------------------------------------------
_GRAMMAR = "0123456789abcdefxX+*?[]_."
_JUNK = "Zz-²٣ \t\n\x00é/:\\"
_PIECES = ["tcp_sync_mss", "tcp_sync_mss+", "vfs_", "tcp_", "0x", "0X", "ffffffff8100", "+",
           "+4", "+0x1", "*", "[", "]", "?", "0", "08", "0777", "²"]
points_text = st.one_of(
    st.lists(st.one_of(st.text(alphabet=_GRAMMAR + _JUNK, max_size=6), st.sampled_from(_PIECES)),
             max_size=6).map("".join),
    st.builds("{}+{}".format, st.sampled_from(["tcp_sync_mss", "vfs_read", "tcp_*", "nosuch"]),
              st.text(alphabet="0123456789abcdefxX+²", max_size=6)))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(what=points_text)
def test_the_point_grammar_ends_in_a_ksim_error_or_points(toy_manager, what):
    from ksim.commands.count import parse_point, resolve_points

    m = toy_manager
    with time_limit(30):
        try:
            spec = parse_point(what)
        except PointSyntaxError:
            return
        if spec.wildcard and sum(fnmatch.fnmatchcase(f.name, what)
                                 for f in m.target.image.functions) > 12:
            return                           # a dry run of every function: the wildcard tests'
        before = state(m)
        try:
            points, _skipped = resolve_points(m, what, "auto")
        except KsimError:
            pass
        else:
            assert points
        assert state(m) == before


# --- 7. the command line: argparse's refusals and the files a command writes ------------------------
@pytest.mark.parametrize("argv,message", [
    (["count", "fib", "--seed", "-1"], "ksim count: argument --seed: must be from 0"),
    (["count", "fib", "--iterations", "many"], "ksim count: argument --iterations: 'many' is not"),
    (["count"], "ksim count: the following arguments are required: FUNC"),
    (["count", "fib", "--bogus"], "ksim: unrecognized arguments: --bogus"),
    (["bogus"], "ksim: argument COMMAND: invalid choice: 'bogus'"),
    ([], "ksim: the following arguments are required: COMMAND"),
    (["kept"], "ksim kept: the following arguments are required: --target"),
    (["trace", "-e", "BEGIN { exit(); }", "--prometheus", "x"], "argument --prometheus: expecting"),
    (["bench", "nosuch"], "ksim bench: argument NAME: invalid choice: 'nosuch'"),
    (["verify", "--workers", "-1"], "ksim verify: argument --workers: must be from 0"),
    (["images", "bogus"], "ksim images: argument ACTION: invalid choice: 'bogus'"),
    (["testbed"], "ksim testbed: the following arguments are required: ACTION"),
])
def test_a_refused_command_line_is_a_json_error_record_under_json(capsys, argv, message):
    """Exit status 2, as argparse's own refusal; with --json the usage error is a JSON
    record on stdout (it printed argparse's text only); without it, argparse's text."""
    from ksim.cli import main

    with pytest.raises(SystemExit) as info:
        main([*argv, "--json"])
    out, err = capsys.readouterr()
    assert info.value.code == 2 and "Traceback" not in err
    assert json.loads(out) == {"error": "usage", "message": json.loads(out)["message"]}
    assert message in json.loads(out)["message"]
    with pytest.raises(SystemExit) as info:
        main(argv)
    out, err = capsys.readouterr()
    assert info.value.code == 2 and not out
    assert err.startswith("usage: ksim") and ": error: " in err


def test_json_after_a_double_dash_is_an_operand_not_the_flag(capsys):
    from ksim.cli import main

    with pytest.raises(SystemExit):
        main(["count", "--seed", "-1", "--", "--json"])
    out, err = capsys.readouterr()
    assert not out and "ksim count: error: argument --seed" in err


@pytest.mark.parametrize("flag", ["--output", "--plot"])
@pytest.mark.parametrize("where", ["directory", "no-parent", "empty"])
def test_bench_refuses_an_output_file_it_cannot_write_before_running(tmp_path, capsys, flag,
                                                                    where):
    """The benchmark ran, then its document ended in a FileNotFoundError or
    IsADirectoryError traceback (and was lost); now nothing runs."""
    path = {"directory": str(tmp_path), "no-parent": str(tmp_path / "none" / "x.json"),
            "empty": ""}[where]
    status, out, err = _cli(["bench", "sizes", "--smoke", "--no-progress", flag, path, "--json"],
                            capsys)
    assert status == 2 and json.loads(out)["error"] == "output-file" and not err
    assert flag in json.loads(out)["message"] and not (tmp_path / "none").exists()
    status, out, err = _cli(["bench", "sizes", "--smoke", "--no-progress", flag, path], capsys)
    assert status == 2 and not out and err.startswith(f"ksim: error: {flag} ")


def test_an_interrupt_is_a_json_error_record_under_json(tmp_path):
    """Ctrl-C while ksim waits (here for a server that accepted and never answers):
    exit status 130, and under --json its record on stdout (it printed none)."""
    import socket
    import sys

    token = tmp_path / "token"
    token.write_text("ab" * 16)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        port = server.getsockname()[1]
        proc = subprocess.Popen(
            [sys.executable, "-m", "ksim.cli", "kept", "--target", f"live://127.0.0.1:{port}",
             "--token-file", str(token), "--json"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        conn, _ = server.accept()
        with conn:
            conn.settimeout(30)
            assert conn.recv(1)                 # the client asked: it waits for the answer
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and b"Traceback" not in err
    assert json.loads(out)["error"] == "interrupted"


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 64), max_size=200), st.integers(1, 256), st.integers(1, 40))
def test_row_tables_are_cut_as_few_as_the_limits_allow(sizes, most, max_rows) -> None:
    """_row_parts: the rows in order, in parts of at most ``max_rows`` rows and ``most``
    bytes (a row over ``most`` alone), each part as long as the next row lets it be:
    the rules written out as an oracle, part by part."""
    from ksim.live import client as live_client
    from ksim.live import protocol as wire

    rows = [(0x1000 * k, n) for k, n in enumerate(sizes)]
    old = wire.MAX_RANGES
    wire.MAX_RANGES = max_rows
    try:
        parts = list(live_client._row_parts(rows, most))
    finally:
        wire.MAX_RANGES = old
    assert [r for part in parts for r in part] == rows
    at = 0
    for part in parts:
        assert part and len(part) <= max_rows
        total = sum(n for _, n in part)
        assert total <= most or len(part) == 1
        at += len(part)
        if at < len(rows):   # the next row would break a limit
            assert len(part) == max_rows or total + rows[at][1] > most
