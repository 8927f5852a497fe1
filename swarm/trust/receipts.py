"""Work receipts: a vouched trainer's signature on each backward it assigns to a peer.

A receipt names the run, the trainer, the microbatch, its sample count, the stage, the step its
forward ran at and the peer the backward went to. The peer that computed the backward keeps it and
shows it to its stage-mates with its contribution to the round; a mate counts only the samples it
holds receipts for, so a member cannot claim work no trainer gave it, nor another peer's.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from collections.abc import Mapping

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from swarm.proto import Receipt, Voucher
from swarm.trust.vouchers import KEY_BYTES, TrustRoot

RECEIPT_DOMAIN = b"swarm-receipt-v1\0"
MAX_ID = 128  # characters in a peer id or run id a receipt may name: far above a libp2p peer id's
KEY_CACHE = 1024  # public key objects kept: one per vouched trainer key
VERIFIED_CACHE = 65536  # receipts whose signature held, remembered: many steps' worth of microbatches


def receipt_message(run_id: str, receipt: Receipt) -> bytes:
    """The bytes a receipt's signature covers: the run, then every field but the key and signature."""
    numbers = struct.pack(">QIIq", receipt.microbatch, receipt.samples, receipt.stage, receipt.step)
    names = b"\0".join(name.encode() for name in (run_id, receipt.trainer, receipt.peer))
    return RECEIPT_DOMAIN + names + b"\0" + numbers


class ReceiptSigner:
    """A trainer's side: signs a receipt for each backward it sends, with its vouched key."""

    def __init__(self, run_id: str, key: Ed25519PrivateKey, voucher: Voucher) -> None:
        self.run_id = run_id
        self.key = key
        self.voucher = voucher

    def sign(self, trainer: str, peer: str, stage: int, microbatch: int, samples: int, step: int) -> Receipt:
        """The receipt for microbatch `microbatch` of `samples` samples, sent to `peer` of `stage`."""
        receipt = Receipt(
            trainer=trainer,
            microbatch=microbatch,
            samples=samples,
            stage=stage,
            step=step,
            peer=peer,
            public_key=self.voucher.public_key,
        )
        receipt.signature = self.key.sign(receipt_message(self.run_id, receipt))
        return receipt


class ReceiptChecker:
    """A peer's side: whether a receipt is one a trainer vouched for by the trust root signed."""

    def __init__(self, root: TrustRoot, run_id: str) -> None:
        self.root = root
        self.run_id = run_id
        self._keys: OrderedDict[bytes, Ed25519PublicKey] = OrderedDict()  # keys of vouchers found good
        self._verified: OrderedDict[tuple[bytes, bytes, bytes], None] = OrderedDict()  # receipts found good

    def vouched(self, voucher: Voucher) -> bool:
        """Whether `voucher` is the root's; its key is then remembered for the receipts it signs."""
        if not self.root.vouches(voucher):
            return False
        key = bytes(voucher.public_key)
        if key not in self._keys:
            self._keys[key] = Ed25519PublicKey.from_public_bytes(key)
            while len(self._keys) > KEY_CACHE:
                self._keys.popitem(last=False)
        return True

    def problem(self, receipt: Receipt, vouchers: Mapping[bytes, Voucher]) -> str | None:
        """What is wrong with `receipt` (None: it is good), its signer's voucher looked up in `vouchers`."""
        if len(receipt.trainer) > MAX_ID or len(receipt.peer) > MAX_ID or len(receipt.public_key) != KEY_BYTES:
            return "a malformed receipt"
        key = bytes(receipt.public_key)
        if key not in self._keys:
            voucher = vouchers.get(key)
            if voucher is None or not self.vouched(voucher):
                return "a receipt signed by a key the trust root did not vouch for"
        message = receipt_message(self.run_id, receipt)
        proven = (key, bytes(receipt.signature), message)
        if proven in self._verified:  # shown again (in progress, then in every offer): checked once
            return None
        try:
            self._keys[key].verify(receipt.signature, message)
        except InvalidSignature:
            return "a receipt whose signature does not hold"
        self._verified[proven] = None
        while len(self._verified) > VERIFIED_CACHE:
            self._verified.popitem(last=False)
        return None
