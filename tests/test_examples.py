"""The example programs run end to end on unicorn:toy and report what the oracle says."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_example(name: str, *args: str) -> str:
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / name), *args],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_count_func_counts_what_the_oracle_counts(toy_path):
    from ksim.kapi import Manager

    out = run_example("count_func.py", "unicorn:toy", "vmlinux", "tcp_sync_mss")
    counted = int(re.search(r"tcp_sync_mss: (\d+) entries", out).group(1))
    with Manager.attach("unicorn:toy") as m:
        with m.oracle(m.find_function("tcp_sync_mss").address) as oracle:
            m.run()
            assert counted == oracle.count > 0
