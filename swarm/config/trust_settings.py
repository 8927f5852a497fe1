"""The trust settings: the swarm's trust root (peers and trainers) and a trainer's voucher."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from swarm.config.options import ConfigError, option


@dataclass
class TrustConfig:
    """Whose work counts: with a trust root, only backwards a vouched trainer signed a receipt for."""

    trust_root: str | None = option(
        None,
        "the organizer's public key (base64, from `swarm trust-root`), published in the swarm file: peers then "
        "count only work that trainers it vouched for assigned, and refuse backwards without their receipt. "
        "Without it the swarm is open: any member's word on the samples it holds is taken",
    )

    def check(self) -> None:
        if self.trust_root is not None:
            from swarm.trust.vouchers import TrustError, decode_key

            try:
                decode_key(self.trust_root, "--trust-root")
            except TrustError as e:
                raise ConfigError(f"{e} (copy the line `swarm trust-root` printed)") from None


@dataclass
class VoucherConfig(TrustConfig):
    """A trainer's trust settings: the trust root, and the voucher that lets it sign receipts."""

    voucher: str | None = option(
        None,
        "the voucher file the organizer made for this trainer with `swarm vouch`: needed where the swarm has a "
        "--trust-root, so that peers count this trainer's microbatches",
    )

    def check(self) -> None:
        TrustConfig.check(self)
        if self.trust_root is not None and self.voucher is None:
            raise ConfigError(
                "this swarm has a trust root: a trainer needs --voucher FILE (ask the organizer to run "
                "`swarm vouch` for this trainer)"
            )
        if self.voucher is not None:
            from swarm.trust.vouchers import TrustError, TrustRoot, load_voucher

            try:
                voucher, _ = load_voucher(Path(self.voucher))
            except TrustError as e:
                raise ConfigError(f"--voucher: {e}") from None
            if self.trust_root is not None and not TrustRoot.from_text(self.trust_root).vouches(voucher):
                raise ConfigError(
                    f"--voucher {self.voucher} is not signed by this swarm's --trust-root: peers would refuse every "
                    "backward; ask the organizer for a voucher of this swarm"
                )


@dataclass
class TrustRootConfig:
    """`swarm trust-root`: makes the organizer's root key and prints the swarm file's `trust_root` line."""

    root_key: str = option("trust-root.key", "where to write the root key (never overwritten; keep it private)")


@dataclass
class VouchConfig:
    """`swarm vouch`: makes a trainer's voucher, signed with the organizer's root key."""

    root_key: str = option("trust-root.key", "the organizer's root key, made by `swarm trust-root`")
    name: str = option("trainer", "the trainer's name in peers' logs")
    out: str = option("trainer.voucher", "where to write the voucher (never overwritten; give it to that trainer)")
