"""The compiled kernel's loader: it builds on a machine like CI's, can be turned off, and never hangs on the
lock of an interrupted earlier build."""

import os
import time

from kvcompress.scoring import native


def test_kernel_builds_here_and_can_be_turned_off(monkeypatch):
    assert native.kernel() is not None  # g++ and torch's BLAS are there: the fast path must not silently vanish
    monkeypatch.setenv("KVCOMPRESS_NATIVE", "0")
    assert native.kernel() is None


def test_a_stale_build_lock_is_removed_and_a_live_one_kept(tmp_path):
    stale, live = tmp_path / "stale", tmp_path / "live"
    stale.touch()
    live.touch()
    old = time.time() - native.STALE_LOCK_SECONDS - 60
    os.utime(stale, (old, old))
    native._remove_stale_lock(stale)
    native._remove_stale_lock(live)
    native._remove_stale_lock(tmp_path / "absent")
    assert not stale.exists() and live.exists()
