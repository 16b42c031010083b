"""Splitting a run across processes started by ``torchrun`` or ``accelerate launch``.

The ranks never talk to each other: each reads ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK``, predicts every
``world_size``-th sample into its own file, and rank 0 waits for all files to be complete and merges them. Going
through files instead of ``torch.distributed`` keeps a rerun after a crash trivial (finished samples are on
disk) and needs no process group, so any launcher and any mix of CPU and GPU works.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

__all__ = ["Shard", "wait_for_samples"]

logger = logging.getLogger(__name__)
T = TypeVar("T")


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
