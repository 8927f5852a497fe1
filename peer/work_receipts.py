"""The receipts of the work this peer holds, and what a stage-mate's receipts let it count.

In a swarm with a trust root, a backward is served only with its trainer's receipt naming this peer,
and kept here until its samples are stepped on (a bounded book: the oldest go first). A contribution
to a round shows the receipts of what it holds; a mate counts only the microbatches whose receipt
is good, names the sender as the peer, matches the sample count and is recent for the round's step.
Everything beyond that is left out of the round, counted and logged with the sender.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import islice

from swarm.config import PeerConfig
from swarm.peer.mate_messages import Held
from swarm.peer.runtime import SampleKey, StageRuntime
from swarm.proto import ErrorCode, PeerInfo, Receipt, StageRequest, Voucher
from swarm.trust.receipts import ReceiptChecker
from swarm.trust.vouchers import TrustRoot

logger = logging.getLogger(__name__)

BOOK_SIZE = 65536  # receipts kept: many steps' worth of microbatches
RECEIPT_STEPS_BEHIND = 2  # a backward's forward may run this many steps before the round it counts in
# a microbatch a peer dropped to take a state is said lost this many steps after its receipt at most: it counts no
# sample (its trainer sends it again), so a state taken a few steps ahead must not leave it unsaid
DROPPED_STEPS_BEHIND = 32
MAX_VOUCHERS = 64  # distinct trainer keys one contribution may show
# a peer gives its state (or counts in the fingerprint majority) only with a receipt naming it this recent: honest
# peers of a stage get work every step or so; one that did none lately has no say over the stage's state
STATE_RECEIPT_STEPS = 8
SHOWN_IN_INFO = 2  # receipts a peer shows with its (step, fingerprint): checking one costs a signature


@dataclass(frozen=True)
class Screened:
    """What of a mate's contribution counts, once its receipts are checked."""

    held: Held  # the microbatches it holds that a receipt names it for
    known: Held  # those it knows a member held that a receipt names that member for
    holders: dict[SampleKey, frozenset[str]]  # per microbatch, the peers its good receipts name
    dropped: Held = field(default_factory=dict)  # those it dropped to take a state that a receipt names it for


def lost_with_the_dead(
    lost: Held,
    holders: dict[SampleKey, frozenset[str]],
    agreed: set[str],
    dropped: dict[SampleKey, frozenset[str]] | None = None,
) -> Held:
    """Of the microbatches no contribution summed, those lost: no peer a receipt names for it is in the round,
    or each one that is says it dropped it to take a state (`dropped`: per microbatch, who says so).

    A member in the round speaks for its own holdings: a microbatch someone says it held, but its
    contribution does not, was never held by it at this step (a replayed receipt, a made-up claim)."""
    dropped = dropped or {}
    speaking = {key: (holders.get(key, frozenset()) & agreed) - dropped.get(key, frozenset()) for key in lost}
    return {key: n for key, n in lost.items() if not speaking[key]}


def dropped_by(contributions: dict) -> dict[SampleKey, frozenset[str]]:
    """Per microbatch, which peers (`contributions`: each peer's `Contribution`) say they dropped it."""
    who: dict[SampleKey, frozenset[str]] = {}
    for peer, contribution in contributions.items():
        for key in contribution.dropped:
            who[key] = who.get(key, frozenset()) | {peer}
    return who


class WorkReceipts:
    """This peer's receipts, and the checks of its callers' and its mates' receipts."""

    def __init__(self, checker: ReceiptChecker, peer_id: str, stage: int) -> None:
        self.checker = checker
        self.peer_id = peer_id
        self.stage = stage
        self._book: OrderedDict[SampleKey, tuple[Receipt, Voucher]] = OrderedDict()  # this peer's own
        # mates' receipts heard of in their progress: per microbatch, per peer named
        self._heard: OrderedDict[SampleKey, dict[str, tuple[Receipt, Voucher]]] = OrderedDict()
        self._acked: dict[tuple[str, int], set[SampleKey]] = {}  # (mate, step): microbatches its progress took
        self._progress_liars: dict[str, int] = {}  # per mate: progress messages that named unreceipted work
        self._latest: dict[str, int] = {}  # per peer: the latest step a good receipt naming it was for
        self._unvouched_states: set[str] = set()  # peers whose state did not count, named once each
        self.refused_backwards = 0  # backwards without a good receipt for this peer
        self.unreceipted_samples = 0  # samples mates claimed in rounds without a good receipt

    def check_backward(self, request: StageRequest, caller: str, samples: int) -> str | None:
        """Why a backward from `caller` cannot be served here (None: its receipt is good)."""
        if not request.HasField("receipt"):
            return "this swarm has a trust root: a backward needs its trainer's receipt (a trainer started --voucher)"
        receipt = request.receipt
        mismatch = (
            receipt.trainer != caller
            or receipt.peer != self.peer_id
            or receipt.stage != self.stage
            or receipt.microbatch != request.microbatch_id
            or receipt.samples != samples
            or receipt.step != request.step
        )
        if mismatch:
            return "the receipt is for another call (trainer, peer, stage, microbatch, samples or step differ)"
        voucher = request.voucher if request.HasField("voucher") else Voucher()
        return self.checker.problem(receipt, {bytes(voucher.public_key): voucher})

    @staticmethod
    def outside_rounds(request: StageRequest, step: int) -> tuple[int, str] | None:
        """Why a backward whose receipt no round of this peer (at `step`) would count cannot be served here, with
        the error code the trainer meets by signing it again for `step`; None where it counts.

        Mates screen a receipt for the round's step, up to `RECEIPT_STEPS_BEHIND` before it and one after, and a
        backward served during a round counts toward the next step. A receipt past `step` + 1 comes to a peer
        behind the step its trainer last reached (restored from a copy that lagged); one before `step` - 1
        from a trainer that started, or retried, behind the stage. The last stage never answers a stale backward
        (it recomputes its forward), so without this it would hold samples its round then leaves out."""
        at = request.receipt.step
        if at > step + 1:
            return ErrorCode.OUT_OF_SYNC, f"this peer is at step {step}, behind the receipt's step {at}"
        if at < step + 1 - RECEIPT_STEPS_BEHIND:
            return ErrorCode.STALE, f"the receipt's step {at} is too old for this peer's round at step {step}"
        return None

    def keep(self, key: SampleKey, request: StageRequest) -> None:
        """Keeps the receipt of a backward this peer applied, for the round that steps on it."""
        self._book[key] = (request.receipt, request.voucher)
        self._book.move_to_end(key)
        self._noted(request.receipt)
        while len(self._book) > BOOK_SIZE:
            self._book.popitem(last=False)

    @staticmethod
    def max_shown(runtime: StageRuntime) -> int:
        """The most receipts a contribution may show: each is a sample at least, and a step's holdings and what
        its members know others held are each at most two target batches; each costs a signature check."""
        return max(4 * runtime.target_batch_size, 64)

    def hear(self, receipt: Receipt, voucher: Voucher | None) -> None:
        """Keeps a good receipt of a mate's holding (from its progress), to show with this peer's offers."""
        key = (receipt.trainer, int(receipt.microbatch))
        self._heard.setdefault(key, {})[receipt.peer] = (receipt, voucher or Voucher())
        self._noted(receipt)
        self._heard.move_to_end(key)
        while len(self._heard) > BOOK_SIZE:
            self._heard.popitem(last=False)

    def unacknowledged(self, peer_id: str, step: int, held: Held) -> tuple[list[Receipt], list[Voucher]]:
        """The receipts of `held` that `peer_id` has not acknowledged at `step`: what progress to it shows.

        Progress messages go out concurrently and may arrive out of order: each shows every receipt not yet
        acknowledged, so whichever arrives first proves every microbatch it names."""
        acked = self._acked.get((peer_id, step), set())
        return self.shown([key for key in held if key not in acked])

    def acknowledged(self, peer_id: str, step: int, keys: Iterable[SampleKey]) -> None:
        """`peer_id` took progress naming `keys` at `step`: their receipts need not go to it again."""
        self._acked.setdefault((peer_id, step), set()).update(keys)
        for old in [entry for entry in self._acked if entry[1] < step - 1]:
            del self._acked[old]

    def screen_progress(
        self,
        sender: str,
        step: int,
        incoming: Held,
        already: Held,
        receipts: Iterable[Receipt],
        vouchers,
        behind: int = RECEIPT_STEPS_BEHIND,
    ) -> Held:
        """What of mate `sender`'s progress at `step` counts: what it named before, and new microbatches it
        shows a good receipt for, at most `behind` steps old (kept, to show with this peer's offers). The rest is
        left out and counted."""
        by_key = {bytes(v.public_key): v for _, v in zip(range(MAX_VOUCHERS), vouchers)}
        proven = {}
        for receipt in receipts:
            key = (receipt.trainer, int(receipt.microbatch))
            fits = incoming.get(key) == receipt.samples and receipt.peer == sender and receipt.stage == self.stage
            recent = step - behind <= receipt.step <= step + 1
            if fits and recent and key not in proven and self.checker.problem(receipt, by_key) is None:
                proven[key] = receipt
                self.hear(receipt, by_key.get(bytes(receipt.public_key)))
        counted = {key: n for key, n in incoming.items() if key in already or key in proven}
        if len(counted) < len(incoming):
            left_out = sum(incoming.values()) - sum(counted.values())
            self.unreceipted_samples += left_out
            self._progress_liars[sender] = self._progress_liars.get(sender, 0) + 1
            level = logging.WARNING if self._progress_liars[sender] == 1 else logging.DEBUG
            logger.log(
                level,
                f"Stage {self.stage} step {step}: progress of mate {sender} names {left_out} samples without a "
                f"receipt naming it; they do not count ({self._progress_liars[sender]} such messages from it)",
            )
        return counted

    def shown(self, held: Iterable[SampleKey], known: Iterable[SampleKey] = ()) -> tuple[list[Receipt], list[Voucher]]:
        """The receipts this peer shows: its own of the microbatches it `held`, and those it heard of from its
        mates of the microbatches it `known` they hold; with the vouchers of their keys.

        Only receipts of what it holds name this peer: one it has of a backward it answered without summing
        (another replica held it) would make it a holder of that microbatch, and no one would find it lost."""
        entries = [self._book.get(key) for key in held]
        entries += [entry for key in known for entry in self._heard.get(key, {}).values()]
        receipts, vouchers = [], {}
        for entry in filter(None, entries):
            receipts.append(entry[0])
            if entry[1].public_key:
                vouchers.setdefault(bytes(entry[1].public_key), entry[1])
        return receipts, list(vouchers.values())

    def screen(
        self,
        sender: str,
        step: int,
        held: Held,
        known: Held,
        receipts: Iterable[Receipt],
        vouchers: Iterable[Voucher],
        dropped: Held | None = None,
    ) -> Screened:
        """What of a contribution by `sender` at `step` counts: the microbatches it holds that a good receipt
        names it for, those it knows a member held that a good receipt names that member for, and those it
        says it `dropped` to take a state that a good receipt names it for.

        Every member screens the same offer alike (the receipts and the trust root decide, nothing of its own),
        so they agree on what counts and on what is lost."""
        by_key = {bytes(v.public_key): v for _, v in zip(range(MAX_VOUCHERS), vouchers)}
        dropped = dropped or {}
        counted_held: Held = {}
        counted_dropped: Held = {}
        holders: dict[SampleKey, set[str]] = {}
        for receipt in receipts:
            key = (receipt.trainer, int(receipt.microbatch))
            behind = DROPPED_STEPS_BEHIND if key in dropped else RECEIPT_STEPS_BEHIND
            recent = step - behind <= receipt.step <= step + 1
            wanted = receipt.samples in (held.get(key), known.get(key), dropped.get(key))
            if not (wanted and recent and receipt.stage == self.stage):
                continue
            if receipt.peer in holders.get(key, ()) or self.checker.problem(receipt, by_key) is not None:
                continue
            holders.setdefault(key, set()).add(receipt.peer)
            self._noted(receipt)
            if receipt.peer == sender and key in held and receipt.step >= step - RECEIPT_STEPS_BEHIND:
                counted_held[key] = receipt.samples
            if receipt.peer == sender and key in dropped:
                counted_dropped[key] = receipt.samples
        counted_known = {key: n for key, n in known.items() if key in holders}
        if len(counted_held) < len(held):
            self._left_out(sender, step, held, counted_held)
        holders_of = {key: frozenset(peers) for key, peers in holders.items()}
        return Screened(counted_held, counted_known, holders_of, counted_dropped)

    def _noted(self, receipt: Receipt) -> None:
        if len(self._latest) < BOOK_SIZE or receipt.peer in self._latest:
            self._latest[receipt.peer] = max(self._latest.get(receipt.peer, 0), int(receipt.step))

    def receipted_since(self, peer_id: str, step: int) -> bool:
        """Whether a good receipt naming `peer_id`, for `step` or later, reached this peer (its own or shown)."""
        return self._latest.get(peer_id, -1) >= step

    def latest_own(self) -> tuple[list[Receipt], list[Voucher]]:
        """The receipts of this peer's latest backwards: what it shows with its (step, fingerprint)."""
        entries = list(islice(reversed(self._book.values()), SHOWN_IN_INFO))
        vouchers = {bytes(v.public_key): v for _, v in entries if v.public_key}
        return [receipt for receipt, _ in entries], list(vouchers.values())

    def proves(self, peer_id: str, step: int, receipts: Iterable[Receipt], vouchers: Iterable[Voucher]) -> bool:
        """Whether `receipts` hold one from a vouched trainer naming `peer_id` on this stage, for a step at most
        `STATE_RECEIPT_STEPS` before `step`: the peer worked for a trainer lately, so its state at `step` may count."""
        by_key = {bytes(v.public_key): v for _, v in zip(range(MAX_VOUCHERS), vouchers)}
        for _, receipt in zip(range(SHOWN_IN_INFO), receipts):
            recent = step - STATE_RECEIPT_STEPS <= receipt.step <= step + 1
            if receipt.peer == peer_id and receipt.stage == self.stage and recent:
                if self.checker.problem(receipt, by_key) is None:
                    self._noted(receipt)
                    return True
        return False

    def vouches_for(self, peer_id: str, info: PeerInfo, initial: tuple[int, str] | None = None) -> bool:
        """Whether `peer_id`'s answered (step, fingerprint) may count toward taking its state: it shows a recent
        receipt naming it (`proves`), or it is `initial`, the state this peer starts from itself (before any
        work, nobody holds a receipt)."""
        if initial is not None and (int(info.step), info.fingerprint) == initial:
            return True
        return self.proves(peer_id, int(info.step), info.receipts, info.vouchers)

    def state_sources(self, infos: dict[str, PeerInfo], initial: tuple[int, str] | None = None) -> dict[str, PeerInfo]:
        """Of the peers that answered their (step, fingerprint), those whose state may count: the ones
        `vouches_for` holds; the others are named once each. None counts where none is vouched, even when every
        peer of the stage joined since a trainer last gave it work (as after an idle spell with churn): taking
        unvouched states then would hand a fresh stage to any two identities announcing a later step."""
        vouched = {p: info for p, info in infos.items() if self.vouches_for(p, info, initial)}
        for peer_id, info in infos.items():
            if peer_id not in vouched:
                level = logging.DEBUG if peer_id in self._unvouched_states else logging.WARNING
                self._unvouched_states.add(peer_id)
                logger.log(
                    level,
                    f"Stage {self.stage}: the state of {peer_id} (step {info.step}, fingerprint {info.fingerprint}) "
                    f"does not count: it shows no receipt from a vouched trainer naming it for step "
                    f"{info.step - STATE_RECEIPT_STEPS} or later",
                )
        return vouched

    def _left_out(self, sender: str, step: int, held: Held, counted: Held) -> None:
        left_out = sum(held.values()) - sum(counted.values())
        self.unreceipted_samples += left_out
        logger.warning(
            f"Stage {self.stage} step {step}: mate {sender} claimed {left_out} samples "
            f"({len(held) - len(counted)} microbatches) without a receipt from a vouched trainer "
            "naming it; they do not count"
        )


def work_receipts(config: PeerConfig, peer_id: str, stage: int) -> WorkReceipts | None:
    """The receipts of a peer of `stage` in a swarm with a trust root (None in an open swarm)."""
    if config.trust_root is None:
        return None
    return WorkReceipts(ReceiptChecker(TrustRoot.from_text(config.trust_root), config.run_id), peer_id, stage)
