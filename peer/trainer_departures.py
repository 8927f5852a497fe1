"""Which trainers have finished training: a stage short of samples lost with a dead mate waits for the trainers
that can still send them again, not for those that will not.

A trainer that finishes publishes a last record that says so, and keeps it up for a while
(`swarm.records.trainer_records.FINISHED_TTL`). A stage whose round went short reads the trainers' records while
it waits; once every microbatch still missing belongs to a finished trainer, it steps without them at once (they
are counted lost by id, as after `--short-wait`) instead of waiting out the whole `--short-wait`.

The record is signed by the trainer's own key, so it speaks only for that trainer's samples: the most a lying
record can do is have its own trainer's samples counted lost sooner. Memory is bounded: at most MAX_REMEMBERED
trainers, each forgotten FINISHED_MEMORY seconds after it was last seen finished.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable

from swarm.records.trainer_records import TrainerRecord, fetch_trainer_records

logger = logging.getLogger(__name__)

READ_PERIOD = 2.0  # seconds between reads of the trainers' records while the stage waits for lost samples
FINISHED_MEMORY = 600.0  # seconds a trainer seen finished is remembered (its record lapses before)
MAX_REMEMBERED = 1024


class TrainerDepartures:
    """The trainers this peer saw finish, remembered a while."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.finished: dict[str, float] = {}  # trainer peer id -> when (clock) it was last seen finished

    def note(self, records: Iterable[TrainerRecord]) -> None:
        """Takes the finished trainers from a read of the trainers' records; a record that trains again (the same
        identity restarted) is no longer finished."""
        now = self.clock()
        for record in records:
            if record.finished:
                self.finished[record.peer_id] = now
            else:
                self.finished.pop(record.peer_id, None)
        fresh = {p: at for p, at in self.finished.items() if now - at < FINISHED_MEMORY}
        # past the cap, those seen finished last are kept: a flood of records cannot grow a peer
        self.finished = dict(sorted(fresh.items(), key=lambda item: item[1])[-MAX_REMEMBERED:])

    def has_finished(self, trainer: str) -> bool:
        """Whether `trainer` was seen finished: nothing of its will be sent again."""
        return trainer in self.finished


async def watch_departures(
    departures: TrainerDepartures,
    waiting_on: Callable[[], set[str]],
    on_news: Callable[[], None],
    dht,
    run_id: str,
    period: float = READ_PERIOD,
) -> None:
    """Until cancelled: while `waiting_on()` names trainers the stage waits for, reads the trainers' records every
    `period` seconds into `departures` and calls `on_news` after each read; reads nothing otherwise."""
    loop = asyncio.get_running_loop()
    while True:
        if waiting_on():
            try:
                records = await loop.run_in_executor(None, fetch_trainer_records, dht, run_id)
            except Exception as e:  # the stage waits out --short-wait, as without this
                logger.debug(f"Could not read the trainers' records: {type(e).__name__}: {e}")
            else:
                departures.note(records)
                on_news()
        await asyncio.sleep(period)
