"""kerninstd's start-up checks (no kernel needed): the token file must be private."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ksim.errors import AuthError
from live import daemon


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


def test_session_log_retires_undone_writes() -> None:
    s = daemon.Session("peer")
    s.log_write(0x100, b"\x0f\x1f", b"\xe9\x00")
    s.log_write(0x100, b"\xe9\x00", b"\xe9\x01")   # re-pointed: still one record
    assert len(s.text) == 1 and s.text[0].orig == b"\x0f\x1f" and s.text[0].cur == b"\xe9\x01"
    s.log_write(0x100, b"\xe9\x01", b"\x0f\x1f")   # restored: no record left
    assert s.text == []
