"""The compiled kernel's loader: it builds on a machine like CI's, can be turned off, and never hangs on the
lock of an interrupted earlier build."""

import os
import time

import pytest
import torch

from kvcompress.kernels import attention, native


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


def test_a_failed_build_warns_once_and_falls_back_to_torch(monkeypatch):
    def no_compiler():
        raise RuntimeError("Error building extension: g++: not found")

    monkeypatch.setattr(native, "_build", no_compiler)
    monkeypatch.setattr(native, "_tried", False)
    monkeypatch.setattr(native, "_kernel", None)
    with pytest.warns(RuntimeWarning, match="could not be built.*g\\+\\+: not found.*torch"):
        assert native.kernel() is None
    assert native.kernel() is None  # no second attempt, no second warning
    queries, keys = torch.randn(1, 2, 5, 4), torch.randn(1, 1, 5, 4)
    live = torch.ones(1, 5, dtype=torch.bool)
    scores, output = attention.observed_attention(queries, keys, live, live, 0.5, values=keys)
    assert output.shape == (1, 5, 2, 4) and torch.allclose(scores.sum(-1), torch.full((1, 1), 10.0))


def test_each_checkout_and_source_text_gets_its_own_build(tmp_path):
    copies = tuple(tmp_path / source.name for source in native.SOURCES)
    for copy, source in zip(copies, native.SOURCES):
        copy.write_text(source.read_text())
    names = {
        native.build_name(native.SOURCES, "AVX2", ["-O3"]),
        native.build_name(copies, "AVX2", ["-O3"]),  # another checkout of the same text
        native.build_name(native.SOURCES, "AVX2", ["-O2"]),
    }
    copies[1].write_text(native.SOURCES[1].read_text() + "// edited\n")  # any of the sources
    names.add(native.build_name(copies, "AVX2", ["-O3"]))
    assert len(names) == 4
    assert native.build_name(native.SOURCES, "AVX2", ["-O3"]) in names  # stable for the same inputs
