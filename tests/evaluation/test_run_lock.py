"""One run per output folder: a second run is refused while the first runs, a stale lock is cleared, the ranks of
one launch share the lock, and a sharded run leaves no shard files or ``shards/`` folder behind.

The resume tests after ``kill -9`` (``test_end_to_end.py``, ``test_ruler_runner.py``) cover a lock left by a killed
run being cleared by the rerun.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvbench.sharding import FolderInUseError, RunLock, Shard, launch_id
from longbench.cli import main

HOLDER = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    from kvbench.sharding import RunLock, Shard

    with RunLock(Path(sys.argv[1]), Shard.from_env()):
        print("held", flush=True)
        if sys.stdin.readline().strip() == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
""")


@pytest.fixture
def holder(tmp_path, runner_env):
    """``holder(lock, **env)``: a process that takes the lock (rank and world size from ``env``) and keeps it
    until it reads a line: ``"kill"`` kills it with SIGKILL inside the lock, anything else releases it."""
    script = tmp_path / "hold.py"
    script.write_text(HOLDER, encoding="utf-8")
    processes = []

    def start(lock: Path, **env: str) -> subprocess.Popen:
        process = subprocess.Popen([sys.executable, str(script), str(lock)], env={**runner_env, **env}, text=True,
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        processes.append(process)
        assert process.stdout.readline() == "held\n"
        return process

    yield start
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait()


def _finish(process: subprocess.Popen, line: str = "\n") -> int:
    process.stdin.write(line)
    process.stdin.close()
    return process.wait(timeout=30)


def _members(lock: Path) -> list[dict]:
    return json.loads(lock.read_text(encoding="utf-8"))["members"]


def _files(root: Path) -> dict[str, bytes]:
    return {path.relative_to(root).as_posix(): path.read_bytes() for path in sorted(root.rglob("*")) if path.is_file()}


def test_a_second_process_is_refused_while_the_first_holds_the_lock(tmp_path, holder):
    lock = tmp_path / "out" / "run.lock"
    first = holder(lock)
    entry = _members(lock)[0]
    started = time.monotonic()
    with pytest.raises(FolderInUseError) as refusal:
        with RunLock(lock, Shard()):
            pass
    assert time.monotonic() - started < 5
    assert str(refusal.value) == (
        f"output_dir: {lock.parent} is in use by another run: pid {first.pid} on {entry['host']} (rank 0 of 1), "
        f"started {entry['started']}: {sys.executable} {tmp_path / 'hold.py'} {lock}. Wait for it to finish or stop "
        f"it; if that process is no longer running (it ran on another machine), delete {lock}"
    )
    assert _members(lock) == [entry]  # the refused process changed nothing
    assert _finish(first) == 0 and not lock.exists()
    with RunLock(lock, Shard()):
        assert [member["pid"] for member in _members(lock)] == [os.getpid()]
    assert not lock.exists()


def test_a_second_run_is_refused_and_the_first_ends_as_if_alone(tmp_path, make_config, runner_env):
    """The real command twice on one folder: the second fails at once, naming the first, which then writes what
    a run alone writes. The first is stopped (SIGSTOP) while the second starts, so that however fast it predicts,
    it is still running when the second one looks."""
    config = make_config(tmp_path / "shared", tasks="all", compression=["none"])
    out = tmp_path / "shared" / "out"
    command = [sys.executable, "-m", "longbench.cli", "predict", str(config)]
    with (tmp_path / "first.log").open("w") as log:
        first = subprocess.Popen(command, env=runner_env, stdout=log, stderr=log)
        try:
            deadline = time.monotonic() + 120
            while (not any(path.stat().st_size for path in out.glob('full/pred/*.jsonl'))
                   and first.poll() is None and time.monotonic() < deadline):
                time.sleep(0.01)
            assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
            first.send_signal(signal.SIGSTOP)
            try:
                started = time.monotonic()
                second = subprocess.run(command, env=runner_env, capture_output=True, text=True, timeout=120)
                refused_after = time.monotonic() - started
            finally:
                first.send_signal(signal.SIGCONT)
            assert first.wait(timeout=300) == 0, (tmp_path / "first.log").read_text()[-3000:]
        finally:
            if first.poll() is None:
                first.kill()
    print(f"second run refused after {refused_after:.1f} s (python, imports and the config included)")
    assert second.returncode == 2
    assert f"kvcompress-longbench: error: output_dir: {out} is in use by another run: pid {first.pid} on " in (
        second.stderr)
    assert "(rank 0 of 1), started " in second.stderr and f"longbench.cli predict {config}. Wait" in second.stderr
    assert not (out / "run.lock").exists()

    alone = make_config(tmp_path / "alone", tasks="all", compression=["none"])
    assert main(["predict", str(alone)]) == 0
    assert _files(out) == _files(tmp_path / "alone" / "out")


def test_the_lock_of_a_killed_process_is_cleared(tmp_path, holder):
    lock = tmp_path / "out" / "run.lock"
    killed = holder(lock)
    assert _finish(killed, "kill\n") == -signal.SIGKILL
    assert [member["pid"] for member in _members(lock)] == [killed.pid]
    with RunLock(lock, Shard()):
        assert [member["pid"] for member in _members(lock)] == [os.getpid()]
    assert not lock.exists()


@pytest.mark.parametrize(("change", "stale"), [
    ({"boot": "an earlier boot"}, True),
    ({"start": "1"}, True),  # the pid now names a process started later
    ({"host": "elsewhere"}, False),  # cannot be proved gone
])
def test_staleness_of_another_runs_entry(tmp_path, change, stale):
    """Another launch's entry naming this (running) process, but for one changed field."""
    lock = tmp_path / "out" / "run.lock"
    lock.parent.mkdir()
    entry = {**RunLock(lock, Shard()).entry, **change}
    lock.write_text(json.dumps({"launch": "another launch", "members": [entry]}), encoding="utf-8")
    if stale:
        with RunLock(lock, Shard()):
            assert [member["pid"] for member in _members(lock)] == [os.getpid()]
        assert not lock.exists()
    else:
        with pytest.raises(FolderInUseError, match=f"pid {os.getpid()} on elsewhere .* delete {lock}$"):
            RunLock(lock, Shard()).__enter__()


def test_ranks_of_one_launch_share_the_lock(tmp_path, holder):
    lock = tmp_path / "out" / "run.lock"
    with RunLock(lock, Shard(0, 2)):
        with RunLock(lock, Shard(1, 2)):  # the same parent process: the same launch
            assert [member["rank"] for member in _members(lock)] == [0, 1]
            with pytest.raises(FolderInUseError, match=r"\(rank 1 of 2\).* need the same KVBENCH_RUN_ID$"):
                RunLock(lock, Shard(1, 2)).__enter__()  # a second rank 1
        with pytest.raises(FolderInUseError, match=r"\(rank 0 of 2\)"):
            RunLock(lock, Shard(1, 2), {"TORCHELASTIC_RUN_ID": "another launch"}).__enter__()
        with pytest.raises(FolderInUseError, match=r"\(rank 0 of 2\)"):
            RunLock(lock, Shard(0, 4)).__enter__()  # another world size is another run
        assert [member["rank"] for member in _members(lock)] == [0]
    assert not lock.exists()

    # A rank started by another parent joins with the launch's id; rank 0 leaving first leaves it the lock.
    env = {"KVBENCH_RUN_ID": "job-7", "WORLD_SIZE": "2"}
    with RunLock(lock, Shard(0, 2), env):
        rank1 = holder(lock, RANK="1", **env)
    assert [member["pid"] for member in _members(lock)] == [rank1.pid]
    assert _finish(rank1) == 0 and not lock.exists()


def test_an_earlier_torchrun_restart_on_another_machine_is_superseded(tmp_path):
    lock = tmp_path / "out" / "run.lock"
    env = {"TORCHELASTIC_RUN_ID": "job-7", "TORCHELASTIC_RESTART_COUNT": "1"}
    old = {**RunLock(lock, Shard(1, 2), env).entry, "host": "elsewhere", "restart": 0}
    lock.parent.mkdir()
    lock.write_text(json.dumps({"launch": "TORCHELASTIC_RUN_ID=job-7, world size 2", "members": [old]}))
    with RunLock(lock, Shard(1, 2), env):
        assert [member["restart"] for member in _members(lock)] == [1]


def test_launch_ids():
    parent = launch_id({})
    assert parent.startswith(f"parent pid {os.getppid()} started at tick ") and launch_id({}) == parent
    assert launch_id({"TORCHELASTIC_RUN_ID": "none"}) == parent  # torchrun's static default names no launch
    assert launch_id({"TORCHELASTIC_RUN_ID": "5f1c"}) == "TORCHELASTIC_RUN_ID=5f1c"
    assert launch_id({"TORCHELASTIC_RUN_ID": "5f1c", "KVBENCH_RUN_ID": "job-7"}) == "KVBENCH_RUN_ID=job-7"


def test_a_sharded_run_removes_its_shard_files_and_folder(tmp_path, make_config, monkeypatch):
    """Two ranks run one after the other in this process: rank 0 merges rank 1's file and its own, then removes
    both and ``shards/``; a late rank 1 with nothing left to do creates nothing. The files equal one process's."""
    tasks = ["qasper", "trec"]
    config = str(make_config(tmp_path / "sharded", tasks=tasks, compression=["none"]))
    out = tmp_path / "sharded" / "out"
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert main(["predict", config]) == 0
    assert sorted(path.name for path in (out / "full" / "shards").iterdir()) == [
        "qasper.rank1.jsonl", "trec.rank1.jsonl"]
    monkeypatch.setenv("RANK", "0")
    assert main(["predict", config]) == 0
    assert not (out / "full" / "shards").exists() and not (out / "run.lock").exists()
    monkeypatch.setenv("RANK", "1")
    assert main(["predict", config]) == 0
    assert not (out / "full" / "shards").exists()

    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    single = str(make_config(tmp_path / "single", tasks=tasks, compression=["none"]))
    assert main(["predict", single]) == 0
    assert _files(out) == _files(tmp_path / "single" / "out")
