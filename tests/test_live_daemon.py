"""kerninstd's start-up checks (no kernel needed): the token file must be private."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ksim.errors import AuthError, ProtocolError
from ksim.live import daemon


def _token(tmp_path: Path, mode: int, body: str = "ab" * 32) -> Path:
    path = tmp_path / "token"
    path.write_text(body)
    os.chmod(path, mode)
    return path


def test_private_token_is_read(tmp_path: Path) -> None:
    assert daemon.read_token(str(_token(tmp_path, 0o600))) == b"ab" * 32


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660])
def test_token_readable_by_others_is_refused(tmp_path: Path, mode: int) -> None:
    with pytest.raises(AuthError, match="chmod 600"):
        daemon.read_token(str(_token(tmp_path, mode)))


def test_short_or_missing_token_is_refused(tmp_path: Path) -> None:
    with pytest.raises(AuthError, match="fewer than 16"):
        daemon.read_token(str(_token(tmp_path, 0o600, "short")))
    with pytest.raises(AuthError):
        daemon.read_token(str(tmp_path / "absent"))


def test_daemon_refuses_to_start_with_a_public_token(tmp_path: Path, capsys) -> None:
    status = daemon.main(["--listen", "127.0.0.1:0", "--token-file", str(_token(tmp_path, 0o644)),
                          "--device", str(tmp_path / "no-device")])
    assert status == 2
    assert "refusing to start" in capsys.readouterr().err


def test_allocators_mirror_the_modules_blocks() -> None:
    """A restarted kerninstd builds its allocators from the module's log: the blocks
    kept owners hold (and freed patch code not yet reusable) are never handed out."""
    base = 0xFFFFFFFFC0000000
    kept = [(base + 0x40, 24), (base, 64), (base + 0x1000, 16)]
    region = daemon.mirror(base, base + 0x2000, "patch area", kept)
    assert region.allocated() == dict(kept)
    assert region.bytes_free == 0x2000 - 104
    fresh = [region.alloc(64, 16) for _ in range(4)]
    assert all(not (a < k + n and k < a + 64) for a in fresh for k, n in kept)
    assert fresh[0] == base + 0x60          # first fit: the first gap that holds 64 bytes
    # a block that leaves the region is not mirrored (and logged)
    assert daemon.mirror(base, base + 0x100, "patch area", [(base + 0xF0, 32)]).allocated() == {}


def test_keep_names_are_checked() -> None:
    assert daemon.check_keep_name("getppid-counter.1") == "getppid-counter.1"
    for bad in ("", "-x", "a b", "orphan-3", "x" * 65, "a/b"):
        with pytest.raises(ProtocolError, match="name"):
            daemon.check_keep_name(bad)
