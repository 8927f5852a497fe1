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

from swarm.config import PeerConfig
from swarm.peer.mate_messages import Held
from swarm.peer.runtime import SampleKey, StageRuntime
from swarm.proto import Receipt, StageRequest, Voucher
from swarm.trust.receipts import ReceiptChecker
from swarm.trust.vouchers import TrustRoot

logger = logging.getLogger(__name__)

BOOK_SIZE = 65536  # receipts kept: many steps' worth of microbatches
RECEIPT_STEPS_BEHIND = 2  # a backward's forward may run this many steps before the round it counts in
MAX_VOUCHERS = 64  # distinct trainer keys one contribution may show


class WorkReceipts:
    """This peer's receipts, and the checks of its callers' and its mates' receipts."""

    def __init__(self, checker: ReceiptChecker, peer_id: str, stage: int) -> None:
        self.checker = checker
        self.peer_id = peer_id
        self.stage = stage
        self._book: OrderedDict[SampleKey, tuple[Receipt, Voucher]] = OrderedDict()
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

    def keep(self, key: SampleKey, request: StageRequest) -> None:
        """Keeps the receipt of a backward this peer applied, for the round that steps on it."""
        self._book[key] = (request.receipt, request.voucher)
        self._book.move_to_end(key)
        while len(self._book) > BOOK_SIZE:
            self._book.popitem(last=False)

    def shown(self, held: Iterable[SampleKey]) -> tuple[list[Receipt], list[Voucher]]:
        """The receipts of `held` that this peer has, and the vouchers of their keys, as an offer shows them."""
        receipts, vouchers = [], {}
        for key in held:
            if (entry := self._book.get(key)) is not None:
                receipts.append(entry[0])
                vouchers.setdefault(bytes(entry[1].public_key), entry[1])
        return receipts, list(vouchers.values())

    @staticmethod
    def max_shown(runtime: StageRuntime) -> int:
        """The most receipts a contribution may show: each is a sample at least, and a step holds its target
        batch and what came in during its round; each costs a signature check before it counts."""
        return max(2 * runtime.target_batch_size, 64)

    def counted(
        self, sender: str, step: int, held: Held, receipts: Iterable[Receipt], vouchers: Iterable[Voucher]
    ) -> Held:
        """What of `held`, claimed by mate `sender` at `step`, counts: the microbatches it shows a good receipt for.

        Every member checks the same offer alike (the receipts and the trust root decide, nothing of its
        own), so they agree on what counts."""
        by_key = {bytes(v.public_key): v for _, v in zip(range(MAX_VOUCHERS), vouchers)}
        receipted: Held = {}
        for receipt in receipts:
            key = (receipt.trainer, int(receipt.microbatch))
            if held.get(key) != receipt.samples or key in receipted:
                continue
            recent = step - RECEIPT_STEPS_BEHIND <= receipt.step <= step + 1
            if receipt.peer != sender or receipt.stage != self.stage or not recent:
                continue
            if self.checker.problem(receipt, by_key) is None:
                receipted[key] = receipt.samples
        if len(receipted) < len(held):
            left_out = sum(held.values()) - sum(receipted.values())
            self.unreceipted_samples += left_out
            logger.warning(
                f"Stage {self.stage} step {step}: mate {sender} claimed {left_out} samples "
                f"({len(held) - len(receipted)} microbatches) without a receipt from a vouched trainer "
                "naming it; they do not count"
            )
        return receipted


def work_receipts(config: PeerConfig, peer_id: str, stage: int) -> WorkReceipts | None:
    """The receipts of a peer of `stage` in a swarm with a trust root (None in an open swarm)."""
    if config.trust_root is None:
        return None
    return WorkReceipts(ReceiptChecker(TrustRoot.from_text(config.trust_root), config.run_id), peer_id, stage)
