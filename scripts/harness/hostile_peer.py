"""A real peer that lies in one place: an insider for scripts/adversary.py and the trust tests.

It is `swarm peer` as users run it (the same flags, key, signed record and protocols), with one
method of its round replaced by the attack named first on its command line:

- `inflate-samples`: each contribution it offers its mates names, beside the microbatches it holds,
  `FAKE_MICROBATCHES` made-up ones of `FAKE_SAMPLES` samples each. Its gradient and its own view of the
  round stay honest, so any difference in what its mates step on comes from believing the claim.
- `reversed-gradient`: every contribution it offers holds its gradient sum reversed and `REVERSED_MULTIPLE`
  times larger, its norm stated truly; its work, samples and receipts stay honest, so only the round's
  bound on a contribution's size can keep it out.
- `fake-progress`: each progress message it sends names, beside what it holds, made-up microbatches
  (as many samples as the stage's target batch): mates that believe it start rounds early, and wait
  for "lost" samples no trainer can send.
- `wrong-outputs`: every forward it answers has its outputs moved by noise (`WRONG_OUTPUT_NOISE`); its
  parameters, backwards and rounds stay honest, so only the trainers' spot checks can tell.
- `wrong-backwards`: every backward it answers has its input gradients moved by noise (`WRONG_GRADIENT_NOISE`
  of their largest value); its forwards, parameters and rounds stay honest: it steers the stages before it.
- `owner-lies`: the sum of its own slice that it sends its mates in every round is its true sum reversed and
  `REVERSED_MULTIPLE` times larger; its parts, norms, projections and work stay honest, so only the mates'
  audit of its sum can tell.
- `state-takeover`: asked for its step and fingerprint, or for its state, it answers with a crafted
  state (every parameter `CRAFTED_VALUE`) `CRAFTED_LEAD` steps past its own: two of them confirm each
  other's version, the most advanced, to a newcomer. Its work and rounds stay honest.
- `near-state-takeover`: the same, one step past its own, where its recent receipts vouch for it.

Started through LocalSwarm's `prefix` (it runs the command line that follows it, in this process):

    python scripts/harness/hostile_peer.py inflate-samples -- python -m swarm peer --stage 1 ...
"""

from __future__ import annotations

import dataclasses
import sys
from functools import partial

FAKE_MICROBATCHES = 4096
FAKE_SAMPLES = 256
REVERSED_MULTIPLE = 100.0
WRONG_OUTPUT_NOISE = 0.1  # standard deviation added to each output of a forward: about 5% of a hidden state's scale
WRONG_GRADIENT_NOISE = 0.1  # standard deviation added to each input gradient, relative to its largest value
CRAFTED_LEAD = {"state-takeover": 1000, "near-state-takeover": 1}  # steps past its own it claims
CRAFTED_VALUE = 0.01  # every parameter of its crafted state: two such peers craft the same one
FAKE_TRAINER = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"  # a well-formed peer id no trainer has


def inflate_samples() -> None:
    """Offers mates a contribution that claims made-up microbatches besides the real ones."""
    from swarm.peer.averaging_round import AveragingRound

    honest = AveragingRound._send_contribution

    async def inflated(self, peer_id, step, own, *args, **kwargs):
        fake = {(FAKE_TRAINER, 1 + i): FAKE_SAMPLES for i in range(FAKE_MICROBATCHES)}
        claimed = {**own.held, **fake}
        lie = dataclasses.replace(own, held=claimed, samples=sum(claimed.values()))
        return await honest(self, peer_id, step, lie, *args, **kwargs)

    AveragingRound._send_contribution = inflated


def reversed_gradient() -> None:
    """Offers mates its gradient sum reversed and `REVERSED_MULTIPLE` times larger (its norm stated truly)."""
    from swarm.peer.averaging_round import AveragingRound

    honest = AveragingRound.round

    async def reversed_round(self, step, grad_sum, held):
        return await honest(self, step, None if grad_sum is None else grad_sum * -REVERSED_MULTIPLE, held)

    AveragingRound.round = reversed_round


def fake_progress() -> None:
    """Tells mates it holds made-up microbatches besides the real ones."""
    from swarm.peer.mate_progress import ProgressExchange

    honest = ProgressExchange.send

    async def boastful(self, peer_id, step, held):
        target = self.machine.runtime.target_batch_size
        fake = {(FAKE_TRAINER, 10_000_000 + step * target + i): 1 for i in range(target)}
        return await honest(self, peer_id, step, {**held, **fake})

    ProgressExchange.send = boastful


def wrong_answers(on_backward: bool) -> None:
    """Answers every forward (or every backward) with its tensors moved by noise (its parameters, its other
    calls and its round stay honest): the trainers' spot checks must catch it."""
    import torch

    from swarm.peer.handler import StageHandler

    honest = StageHandler._answer

    def noisy(t):
        if not t.is_floating_point():
            return t
        if on_backward:
            return t + WRONG_GRADIENT_NOISE * float(t.abs().max()) * torch.randn_like(t)
        return t + WRONG_OUTPUT_NOISE * torch.randn_like(t)

    async def wrong(self, result, backward, *args, **kwargs):
        if backward == on_backward:
            result = dataclasses.replace(result, tensors=[noisy(t) for t in result.tensors])
        return await honest(self, result, backward, *args, **kwargs)

    StageHandler._answer = wrong


def owner_lies() -> None:
    """Sends mates a reversed, `REVERSED_MULTIPLE` times larger sum of its slice in every round."""
    from swarm.peer.slice_exchange import SliceExchange

    honest = SliceExchange._reduce

    async def lying(self, *args, **kwargs):
        summed = await honest(self, *args, **kwargs)
        if summed is None:
            return None
        total, norms = summed
        return -REVERSED_MULTIPLE * total, norms

    SliceExchange._reduce = lying


def state_takeover(lead: int) -> None:
    """Answers info and state requests with a crafted state `lead` steps past its own."""
    import torch

    from swarm.net.wire import pack_frames
    from swarm.peer.handler import StageHandler
    from swarm.peer.stage_state import state_fingerprint
    from swarm.peer.state_handover import StateHandOver
    from swarm.peer.state_transfer import encode_state
    from swarm.proto import PROTOCOL_VERSION, StateReply

    def crafted(module) -> list:
        return [torch.full_like(p.detach(), CRAFTED_VALUE) for p in module.parameters()]

    honest_info = StageHandler.info

    def info(self):
        answer = honest_info(self)
        answer.step += lead
        answer.fingerprint = state_fingerprint(crafted(self.runtime.module))
        return answer

    async def give(self, requester, request, _parts, reply):
        runtime = self.machine.runtime
        given = StateReply(protocol_version=PROTOCOL_VERSION, step=runtime.step + lead)
        return pack_frames(given, await encode_state(crafted(runtime.module)))

    StageHandler.info = info
    StateHandOver._answer = give


ATTACKS = {
    "inflate-samples": inflate_samples,
    "reversed-gradient": reversed_gradient,
    "fake-progress": fake_progress,
    "wrong-outputs": partial(wrong_answers, on_backward=False),
    "wrong-backwards": partial(wrong_answers, on_backward=True),
    "owner-lies": owner_lies,
    **{name: partial(state_takeover, lead) for name, lead in CRAFTED_LEAD.items()},
}


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] not in ATTACKS or "--" not in argv:
        sys.exit(f"usage: hostile_peer.py {{{','.join(ATTACKS)}}} -- python -m swarm peer FLAGS...")
    ATTACKS[argv[0]]()
    command = argv[argv.index("--") + 1 :]
    # the command LocalSwarm would have run: `python -m swarm ROLE FLAGS`, run here instead
    role_at = command.index("swarm") + 1
    from swarm.cli import main as swarm_main

    return swarm_main(command[role_at:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
