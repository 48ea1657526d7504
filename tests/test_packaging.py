"""An installed (non-editable) ksim works away from its source tree: the bundled
image's sources travel inside the package and are built into a fresh cache."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_a_plain_install_counts_on_the_toy_kernel(tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--target", str(target), str(ROOT)], check=True, capture_output=True)
    assert (target / "ksim" / "images" / "src" / "toy" / "Makefile").is_file()
    env = {**os.environ, "PYTHONPATH": str(target), "KSIM_CACHE": str(tmp_path / "cache")}
    env.pop("KSIM_IMAGES_DIR", None)
    proc = subprocess.run([sys.executable, "-m", "ksim", "count", "fib", "--iterations", "20"],
                          cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "matches the oracle" in proc.stdout
