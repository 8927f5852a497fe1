"""How long a stage's averaging round waits for a member, and how it finds out that one died.

A round phase (the offers, the commits, the slices) waits for the members it misses. A member that
no longer announces itself serving is given `ABSENT_GRACE` seconds, one that does the whole averaging
timeout: a peer that has just died can leave a connection that hangs rather than fails, and its
expired record says it is gone long before the timeout would. With a trust root, so is a serving mate
that no receipt ever named: it holds nothing that counts, and identities that announce themselves
serving and answer nothing are free to make. Meanwhile each member waited for is asked whether it lives,
`FIRST_PROBE` seconds after the phase found it missing and every `PROBE_EVERY` seconds after that: one
that cannot be dialled is dropped at once, and so is one whose direct address another call of this peer
found refusing connections where it answered (a killed process's closed port), since a mate
that died after taking this peer's message sends nothing and its record outlives it by its TTL.
A member that lets `SILENT_PROBES` probes in a row time out is dropped too: a peer killed at once can
leave its libp2p daemon behind for a while, which takes the call and never answers it. So is one that
answers from another stage: a peer that moved (to restore a lost stage, say) lives on, but sends
nothing more for this stage's rounds. One that answers from a later step has stepped on this round
without this peer (their views of its members differed): this peer takes the mates' state, which ends
the round here (`StepMachine.check_left_behind`), rather than wait for what will not come. One that answers
from this step is sent this peer's offer again (`nudge`): a peer that joined while the round was under way
can miss its start, and a round whose members each wait for another stood still until a wave killed one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from hivemind.p2p import PeerID

from swarm.net.transport import StageCallError, found_gone, get_peer_info
from swarm.peer.mate_membership import MateMembership
from swarm.peer.step_machine import StepMachine
from swarm.proto import ErrorCode, PeerInfo

logger = logging.getLogger(__name__)

ABSENT_GRACE = 5.0  # seconds a round waits for a member whose DHT record no longer says it serves
PROBE_EVERY = 2.0  # seconds between a round's questions whether a member it waits for lives
# seconds a member may be missing before the first question: a mate killed mid-round held every round of its
# stage for PROBE_EVERY (traced), while a probe is one small call that a live mate answers at once
FIRST_PROBE = 0.5
# a waiting phase looks again at least this often: the DHT view or the probes may drop a member meanwhile
WAKE_EVERY = FIRST_PROBE
PROBE_TIMEOUT = 5.0
SILENT_PROBES = 2  # probes in a row that time out before a member counts as dead


class RoundWaiting:
    """The waiting rules every phase of a stage's rounds shares (`averaging_round`, `slice_exchange`)."""

    def __init__(self, machine: StepMachine, membership: MateMembership, averaging_timeout: float) -> None:
        self.machine = machine
        self.membership = membership
        self.averaging_timeout = averaging_timeout
        self._silent: dict[str, int] = {}  # member -> probes in a row it let time out

    def wait_for(self, missing: set[str], started: float) -> float:
        """Seconds a phase that began at `started` still waits for `missing` members (0: no longer)."""
        now = self.machine.loop.time()
        mates = {p for p in self.membership.mates if self.worked(p)}
        limit = self.averaging_timeout if missing & mates else min(ABSENT_GRACE, self.averaging_timeout)
        remaining = started + limit - now
        return 0.0 if remaining <= 0 else max(0.01, min(remaining, WAKE_EVERY))

    def call_timeout(self, peer_id: str) -> float:
        """How long a call to a member may take: a mate that never worked is given up on as soon as it would be
        no longer waited for."""
        return self.averaging_timeout if self.worked(peer_id) else min(ABSENT_GRACE, self.averaging_timeout)

    def worked(self, peer_id: str) -> bool:
        """Whether mate `peer_id` may hold work that counts: always without a trust root; with one, once a good
        receipt named it."""
        receipts = self.machine.receipts
        return receipts is None or receipts.receipted_since(peer_id, 0)

    def probe_late(
        self,
        step: int,
        missing: set[str],
        probed: dict[str, float],
        gone: set[str],
        nudge: Callable[[str], None] | None = None,
    ) -> None:
        """Probes the members a phase waits for, `FIRST_PROBE` seconds after it first found each missing and every
        `PROBE_EVERY` seconds after (`probed`: when last, or when it would have been for the first probe's delay);
        those that cannot be dialled are added to `gone`, and the phase is woken. One alive at this step is
        `nudge`d. A member whose direct address this peer already found refusing connections is dropped at once."""
        now = self.machine.loop.time()
        for peer_id in missing - gone:
            if found_gone(self.machine.p2p, peer_id):
                self._drop(step, peer_id, "it refuses connections where it answered", gone)
            elif now - probed.setdefault(peer_id, now - PROBE_EVERY + FIRST_PROBE) >= PROBE_EVERY:
                probed[peer_id] = now
                self.machine.spawn(self._probe(step, peer_id, gone, nudge))

    async def _probe(self, step: int, peer_id: str, gone: set[str], nudge: Callable[[str], None] | None = None) -> None:
        """Asks a member whether it lives: one that cannot be dialled, or that let `SILENT_PROBES` probes in a row
        time out, is dropped at once rather than at the timeout (any other answer is a sign of life)."""
        machine = self.machine
        try:
            info = await get_peer_info(machine.p2p, PeerID.from_base58(peer_id), PROBE_TIMEOUT)
        except StageCallError as e:
            if e.code != ErrorCode.UNAVAILABLE:
                self._silent.pop(peer_id, None)
                return
            why = e.detail
            if "no reply within" in why:
                self._silent[peer_id] = self._silent.get(peer_id, 0) + 1
                if self._silent[peer_id] < SILENT_PROBES:
                    return
                why = f"{SILENT_PROBES} probes in a row had no reply within {PROBE_TIMEOUT:.0f}s"
            self._drop(step, peer_id, why, gone)
        else:
            self._silent.pop(peer_id, None)
            if (elsewhere := self._elsewhere(info)) is not None:
                self._drop(step, peer_id, elsewhere, gone)
            elif info.step > step:  # it stepped on this round without this peer, as a reply from a later step says
                machine.mate_stepped_past(step, peer_id, info.step)
            elif info.step == step and nudge is not None and machine.runtime.step == step:
                nudge(peer_id)

    def _elsewhere(self, info: PeerInfo) -> str | None:
        """Why a member that answered takes no part in this stage's rounds any more, if so."""
        return f"it serves stage {info.stage} now" if info.stage != self.machine.stage else None

    def _drop(self, step: int, peer_id: str, why: str, gone: set[str]) -> None:
        self._silent.pop(peer_id, None)
        logger.warning(f"Stage {self.machine.stage} step {step}: mate {peer_id} is gone ({why}); dropping it")
        self.membership.mark_unreachable(peer_id)
        gone.add(peer_id)
        self.machine.changed.set()
