"""Splitting a run across processes started by ``torchrun`` or ``accelerate launch``, and one run per folder.

The ranks never talk to each other: each reads ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK``, predicts every
``world_size``-th sample into its own file, and rank 0 waits for all files to be complete and merges them. Going
through files instead of ``torch.distributed`` keeps a rerun after a crash trivial (finished samples are on
disk) and needs no process group, so any launcher and any mix of CPU and GPU works. The same files make two runs
in one folder destructive (one merges and deletes the shard files the other writes), hence ``RunLock``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import fcntl
import json
import logging
import os
import shlex
import socket
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from .config import ConfigError

__all__ = ["FolderInUseError", "RUN_ID_VARIABLE", "RunLock", "Shard", "launch_id", "wait_for_samples"]

logger = logging.getLogger(__name__)
T = TypeVar("T")
RUN_ID_VARIABLE = "KVBENCH_RUN_ID"  # names one run across separately launched ranks


@dataclasses.dataclass(frozen=True)
class Shard:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> "Shard":
        """Reads the launcher's variables; a plain ``python`` run is rank 0 of 1."""
        values = {}
        for name, default in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", None)):
            raw = env.get(name, default)
            if raw is None:
                continue
            try:
                values[name] = int(raw)
            except ValueError:
                raise ValueError(f"environment variable {name} must be an integer, got {raw!r}") from None
        rank, world_size = values["RANK"], values["WORLD_SIZE"]
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= RANK < WORLD_SIZE, got RANK={rank}, WORLD_SIZE={world_size}")
        return cls(rank, world_size, values.get("LOCAL_RANK", rank))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def select(self, items: Sequence[T]) -> list[T]:
        """This rank's samples, ``items[rank::world_size]`` as in the official pred.py."""
        return list(items[self.rank::self.world_size])


def wait_for_samples(
    missing: Callable[[], int], what: str, timeout: float, poll_interval: float = 2.0
) -> None:
    """Blocks until ``missing()`` returns 0; fails after ``timeout`` seconds without progress.

    The clock restarts whenever the count drops, so slow ranks are waited for as long as they make progress,
    while a crashed rank ends the wait with an error instead of a hang.
    """
    remaining, last_progress = missing(), time.monotonic()
    if remaining:
        logger.info("%s: waiting for %d sample(s) from the other ranks", what, remaining)
    while remaining:
        if time.monotonic() - last_progress > timeout:
            raise TimeoutError(
                f"{what}: {remaining} sample(s) still missing after {timeout:.0f} s without progress; a rank has "
                "probably died. Rerun the same command on all ranks: finished samples are kept"
            )
        time.sleep(poll_interval)
        now_missing = missing()
        if now_missing < remaining:
            last_progress = time.monotonic()
        remaining = now_missing


class FolderInUseError(ConfigError):
    """Another run is predicting into the same output folder (or its lock file cannot be read)."""


def launch_id(env: Mapping[str, str] = os.environ) -> str:
    """Names the launch this process belongs to: the same for every rank that one ``torchrun`` / ``accelerate
    launch`` (or one shell) started, different for another launch, so that ranks share one run lock and a second
    launch is refused.

    In order: ``KVBENCH_RUN_ID`` when set (ranks started by hand, or a launch over several machines without a
    rendezvous id); torchrun's rendezvous id (``TORCHELASTIC_RUN_ID``: a fresh uuid for a one-machine launch, the
    job's id over several machines) unless it is the static default ``none``; otherwise the parent process on
    this machine (torchrun's agent, accelerate, the shell), named by pid and start time so that a reused pid
    is another parent. A torchrun whose workers outlived it gives them a new parent, so a relaunch is another run.
    """
    explicit = env.get(RUN_ID_VARIABLE)
    if explicit:
        return f"{RUN_ID_VARIABLE}={explicit}"
    elastic = env.get("TORCHELASTIC_RUN_ID", "none")
    if elastic != "none":
        return f"TORCHELASTIC_RUN_ID={elastic}"
    parent = os.getppid()
    return f"parent pid {parent} started at tick {_process_start(parent)} on {socket.gethostname()} boot {_boot_id()}"


def _boot_id() -> str | None:
    """This boot of this machine (Linux); pids of an earlier boot name no process."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text(encoding="ascii").strip()
    except OSError:
        return None


def _process_stat(pid: int) -> tuple[str, str] | None:
    """A process's state letter and start time (clock ticks since boot) from ``/proc``; None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()  # after "pid (name) ", which may hold spaces: state, then ...
    return fields[0], fields[19]  # ... the start time, field 22 of proc(5)


def _process_start(pid: int) -> str | None:
    """With the pid, names one process: a pid reused by a later process has a later start. None without /proc."""
    stat = _process_stat(pid)
    return None if stat is None else stat[1]


def _running(member: Mapping[str, Any]) -> bool:
    """Whether a lock member's process may still run. Only a process of this machine can be proved gone: by
    another boot, a pid that names no process, a zombie, or a pid now held by a process started later."""
    if member["host"] != socket.gethostname():
        return True
    if member["boot"] != _boot_id():
        return False
    if Path("/proc/self/stat").exists():
        stat = _process_stat(member["pid"])
        return stat is not None and stat[0] not in "ZX" and stat[1] == member["start"]
    try:  # no /proc (macOS): whether the pid exists at all
        os.kill(member["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True


class RunLock:
    """One run per output folder: ``with RunLock(path, shard):`` around everything a run writes there.

    The lock file names the launch (``launch_id`` and the world size) and holds one entry per rank that joined:
    rank, pid, host, boot, process start, torchrun restart count, wall-clock start and command line. A rank joins
    when every entry still running belongs to its launch and to another rank; otherwise it is refused, naming
    the running process. Whichever rank of a launch comes first writes the file, so no rank waits for another.
    Entries whose processes are provably gone (``_running``) are stale and dropped, as are, within a launch,
    those of an earlier torchrun restart (torchrun stopped them), so a run killed with ``kill -9`` resumes with the
    same command. Each rank removes its entry on the way out; the last one removes the file.

    Every read-modify-write of the file happens under ``flock``, held for milliseconds, never for the run: the
    entries, not the kernel, say who holds the folder, so a rank of the same launch can join and a record
    can name the process to wait for.
    """

    def __init__(self, path: Path, shard: Shard, env: Mapping[str, str] = os.environ) -> None:
        self.path = path
        self.shard = shard
        self.launch = f"{launch_id(env)}, world size {shard.world_size}"
        self.entry: dict[str, Any] = {
            "rank": shard.rank, "world_size": shard.world_size, "pid": os.getpid(), "host": socket.gethostname(),
            "boot": _boot_id(), "start": _process_start(os.getpid()),
            "restart": int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
            "started": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": shlex.join(sys.orig_argv),
        }

    def __enter__(self) -> "RunLock":
        with self._file() as descriptor:
            record = self._read(descriptor)
            live = [entry for entry in record["members"] if _running(entry)] if record else []
            if record and record["launch"] == self.launch:
                live = [entry for entry in live if entry["restart"] >= self.entry["restart"]]
                others = [entry for entry in live if entry["rank"] == self.shard.rank]
            else:
                others = live
            if others:
                raise FolderInUseError(self._refusal(min(others, key=lambda entry: entry["rank"])))
            gone = [entry["pid"] for entry in record["members"] if entry not in live] if record else []
            if gone:
                logger.info("%s: cleared the entries of pid(s) %s, no longer running", self.path, gone)
            self._write(descriptor, {"launch": self.launch, "members": [*live, self.entry]})
        return self

    def __exit__(self, *exc_info: object) -> None:
        with self._file() as descriptor:
            record = self._read(descriptor)
            members = [entry for entry in record["members"] if entry != self.entry] if record else []
            if record and any(_running(entry) for entry in members):
                self._write(descriptor, {**record, "members": members})
            else:
                self.path.unlink()

    @contextlib.contextmanager
    def _file(self) -> Iterator[int]:
        """The lock file, open and flocked; the file itself, not one a concurrent ``__exit__`` just removed."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            descriptor = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX)
                try:
                    current = os.path.samestat(os.fstat(descriptor), os.stat(self.path))
                except FileNotFoundError:
                    current = False
                if current:
                    yield descriptor
                    return
            finally:
                os.close(descriptor)  # releases the flock

    def _read(self, descriptor: int) -> dict[str, Any] | None:
        """The record, or None for a file just created; a damaged one raises rather than risk two runs."""
        data = os.pread(descriptor, os.fstat(descriptor).st_size, 0)
        if not data:
            return None
        try:
            record = json.loads(data)
            return {"launch": record["launch"], "members": list(record["members"])}
        except (ValueError, KeyError, TypeError):
            raise FolderInUseError(
                f"output_dir: cannot read {self.path}, which says which run uses {self.path.parent}; delete it if "
                "no run does"
            ) from None

    @staticmethod
    def _write(descriptor: int, record: Mapping[str, Any]) -> None:
        data = (json.dumps(record, indent=2) + "\n").encode("utf-8")
        os.pwrite(descriptor, data, 0)
        os.ftruncate(descriptor, len(data))  # after the write: a crash in between leaves an unreadable file, not
        os.fsync(descriptor)                 # an empty one that would let a second run in

    def _refusal(self, holder: Mapping[str, Any]) -> str:
        message = (
            f"output_dir: {self.path.parent} is in use by another run: pid {holder['pid']} on {holder['host']} "
            f"(rank {holder['rank']} of {holder['world_size']}), started {holder['started']}: {holder['command']}. "
            f"Wait for it to finish or stop it; if that process is no longer running (it ran on another machine), "
            f"delete {self.path}"
        )
        if self.shard.world_size > 1:
            message += f". Ranks of one run started by separate launches need the same {RUN_ID_VARIABLE}"
        return message
