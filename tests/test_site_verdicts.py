"""One verdict for "may this site be touched": can_insert, insert_snippet and the CLI
agree, the refusal names its cause with its own error, and nothing changes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ksim.errors import Blacklisted
from ksim.kapi import Manager
from ksim.snippets import ast

TRAP_PATH = ("ksim_int3_entry", "timer_interrupt", "exception_common", "__switch_to_asm")


@pytest.fixture(scope="module")
def manager():
    m = Manager.attach("unicorn:toy")
    yield m
    m.detach()


@pytest.mark.parametrize("name", TRAP_PATH)
@pytest.mark.parametrize("splice", ["trap", "jmp", "auto"])
def test_the_toy_trap_path_is_refused_everywhere(manager, name, splice):
    point = manager.entry_point(name)
    before = manager.text_snapshot()
    why = manager.can_insert(point, splice)
    assert why is not None and "never be instrumented" in why and name in why
    counter = manager.malloc(8)
    with pytest.raises(Blacklisted) as exc:
        manager.insert_snippet(point, counter.atomic_assign(counter + 1), splice=splice)
    assert str(exc.value) == why
    assert manager.text_snapshot() == before
    assert manager.splices() == {}
    manager.free(counter)


def test_the_command_line_gives_the_same_verdict(manager):
    why = manager.can_insert(manager.entry_point("ksim_int3_entry"), "trap")
    proc = subprocess.run([sys.executable, "-m", "ksim.cli", "count", "ksim_int3_entry",
                           "--splice", "trap", "--json"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    doc = json.loads(proc.stdout)
    assert doc == {"error": Blacklisted.code, "message": why}


def test_every_instruction_of_a_blacklisted_function_is_refused(manager):
    func = manager.find_function("ksim_int3_entry")
    code = manager.facts.function_code(func)
    assert all(code.hazards.get(i.address) == frozenset({"blacklist"}) for i in code.insns)
    inner = manager.point_at(code.insns[3].address)
    with pytest.raises(Blacklisted):
        manager.insert_snippet(inner, ast.Seq(()), splice="trap")
