"""The two ends of a stage's state protocol, shared by stage-mates and standby holders.

The giver answers a `StateRequest` with a `StateReply` and the state's tensors, uncompressed
(`state_handler`, `encode_state`). The taker asks (`request_state`), checks the tensors against its
own stage, and loads them on the runtime thread between steps (`load_into_runtime`). A taker trusts
a (step, fingerprint) only where two of the stage's peers hold it (`confirmed_versions`), so one
lying peer cannot take a stage over.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
from hivemind.p2p import P2P, PeerID

from swarm.compression import get_codec
from swarm.net.allowlist import Handler
from swarm.net.transport import STATE_PROTOCOL, exchange, get_peer_info
from swarm.net.wire import Part, WireLimits, decode_tensors, encode_tensor
from swarm.peer.mate_messages import MAX_IDS, Held, ids_from_wire
from swarm.peer.protocol_handler import Answer, protocol_handler
from swarm.peer.runtime import SampleKey, StageRuntime
from swarm.peer.stage_state import StageStateError, load_state_tensors, state_fingerprint
from swarm.peer.step_machine import StepState
from swarm.proto import PROTOCOL_VERSION, ErrorCode, PeerInfo, StateReply, StateRequest
from swarm.records.stage_records import SERVING, StageRecord

Version = tuple[int, str]  # (step, parameter fingerprint) of a stage's state


@dataclass
class MateState:
    """A stage's state as a peer gave it (`request_state`)."""

    step: int
    tensors: list[torch.Tensor]
    has_optimizer_state: bool
    samples_stepped: int
    held: dict[str, Held]  # the microbatches each other member is known to hold toward `step`
    held_next: dict[str, Held]  # and toward the step after it
    attempt: int  # rounds at `step` the giver has found short so far
    recently_summed: frozenset[SampleKey]  # what the giver's last rounds summed: the state includes them


# --- the giver ---------------------------------------------------------------------------------------------


def state_handler(answer: Answer, failure: str, caller: str) -> Handler:
    """The stream handler of a request for a stage's state; `answer` gives the frames (see `protocol_handler`)."""
    return protocol_handler(
        StateRequest, lambda: StateReply(protocol_version=PROTOCOL_VERSION), answer, WireLimits(), failure, caller
    )


async def encode_state(tensors: list[torch.Tensor]) -> list[Part]:
    """The state's tensors as wire parts, uncompressed, encoded off the event loop."""
    return await asyncio.get_running_loop().run_in_executor(
        None, lambda: [p for t in tensors for p in encode_tensor(t, get_codec("none"))]
    )


# --- the taker ---------------------------------------------------------------------------------------------


async def request_state(
    p2p: P2P, peer_id: str, model: str, stage: int, limits: WireLimits, timeout: float = 120.0
) -> MateState:
    """Asks a peer for its stage's state, or StageStateError."""
    request = StateRequest(protocol_version=PROTOCOL_VERSION, model=model, stage=stage)
    reply, parts = await asyncio.wait_for(
        exchange(p2p, PeerID.from_base58(peer_id), STATE_PROTOCOL, [request], StateReply, limits), timeout
    )
    if reply.error.code != ErrorCode.OK:
        raise StageStateError(f"{ErrorCode.Name(reply.error.code)}: {reply.error.message}")
    if len(reply.recently_summed) > MAX_IDS:
        raise StageStateError(f"the state names {len(reply.recently_summed)} summed microbatches, over {MAX_IDS}")
    named = sum(len(entry.ids) for entry in [*reply.held, *reply.held_next])
    if named > 2 * MAX_IDS:
        raise StageStateError(f"the state names {named} microbatches its mates hold, over {2 * MAX_IDS}")
    tensors = await asyncio.get_running_loop().run_in_executor(None, decode_tensors, parts, limits)
    return MateState(
        step=reply.step,
        tensors=tensors,
        has_optimizer_state=reply.has_optimizer_state,
        samples_stepped=reply.samples_stepped,
        held={entry.peer: ids_from_wire(entry.ids) for entry in reply.held},
        held_next={entry.peer: ids_from_wire(entry.ids) for entry in reply.held_next},
        attempt=reply.attempt,
        recently_summed=frozenset((i.trainer, int(i.microbatch)) for i in reply.recently_summed),
    )


def take_holdings(steps: dict[int, StepState], step: int, given: MateState, own_id: str) -> None:
    """Notes what the giver of a state at `step` knew each member to hold toward that step and the next: should
    one of them die before its round, this peer knows exactly which samples were lost and asks for them again."""
    for at, holdings in ((step, given.held), (step + 1, given.held_next)):
        for mate, ids in holdings.items():
            if mate != own_id:
                steps[at].progress.setdefault(mate, {}).update(ids)


async def parameters_fingerprint(module: torch.nn.Module, tensors: list[torch.Tensor]) -> str:
    """The fingerprint of the parameters among a state's `tensors` (checked against `module` already)."""
    count = sum(1 for _ in module.parameters())
    return await asyncio.get_running_loop().run_in_executor(None, state_fingerprint, tensors[:count])


async def load_into_runtime(
    runtime: StageRuntime, step: int, tensors: list[torch.Tensor], has_optimizer_state: bool, samples_stepped: int
) -> dict[SampleKey, int]:
    """Loads a checked state into the runtime's stage and optimizer, on its thread, before any queued work; returns
    the microbatches whose accumulated gradients the load dropped."""

    def apply() -> None:
        load_state_tensors(runtime.module, runtime.optimizer, tensors, has_optimizer_state)

    return await asyncio.wrap_future(
        runtime.run_exclusive(lambda: runtime.load_state(step, apply, samples_stepped), front=True)
    )


async def peer_versions(
    p2p: P2P,
    peers: list[str],
    model: str,
    stage: int,
    timeout: float,
    sources: Callable[[dict[str, PeerInfo]], dict[str, PeerInfo]] | None = None,
    known: dict[str, PeerInfo] | None = None,
) -> dict[str, Version]:
    """Each of `peers`' (step, fingerprint) for `stage`, as it answers now (the silent ones left out, and with
    `sources`, those it leaves out of the answers: in a swarm with a trust root, the peers that show no recent
    receipt from a vouched trainer). `known`: answers in hand already (a liveness probe's, this period), taken
    instead of asking those peers again."""
    known = {p: info for p, info in (known or {}).items() if p in peers}
    asked = [p for p in peers if p not in known]
    infos = await asyncio.gather(
        *(get_peer_info(p2p, PeerID.from_base58(p), timeout=timeout) for p in asked), return_exceptions=True
    )
    answered = {
        peer_id: info
        for peer_id, info in [*zip(asked, infos), *known.items()]
        if isinstance(info, PeerInfo)
        and info.error.code == ErrorCode.OK
        and info.model == model
        and info.stage == stage
        and info.state == SERVING
        and info.fingerprint
    }
    if sources is not None:
        answered = sources(answered)
    return {peer_id: (int(info.step), info.fingerprint) for peer_id, info in answered.items()}


def announced_versions(serving: list[StageRecord]) -> dict[str, Version]:
    """Each of a stage's `serving` peers' newest (step, fingerprint) that its record announces and as many other
    records as `confirmed_versions` asks for do too (records are built a moment apart, at different steps: each
    lists its last ones). A peer whose record shares none is left out."""
    histories = {r.peer_id: set(r.versions) for r in serving if r.state == SERVING and r.versions}
    counts = Counter(version for history in histories.values() for version in history)
    shared = {version for version, n in counts.items() if n >= min(2, len(serving))}
    return {peer_id: max(history & shared) for peer_id, history in histories.items() if history & shared}


def confirmed_versions(versions: dict[str, Version]) -> set[Version]:
    """The (step, fingerprint) pairs that at least two mates hold (or the one mate's, if only one answered)."""
    counts = Counter(versions.values())
    return {version for version, n in counts.items() if n >= min(2, len(versions))}


def newest_confirmed(versions: dict[str, Version]) -> int:
    """The step of the newest version `confirmed_versions` finds in `versions`; -1 if none."""
    return max((version[0] for version in confirmed_versions(versions)), default=-1)


def confirmed_holders(versions: dict[str, Version], minimum_step: int = 0) -> list[str]:
    """Mates holding a confirmed version at `minimum_step` or later: first the version most of them hold, the most
    advanced among equals, so that a crafted version ahead is taken only from as many insiders as honest peers."""
    counts = Counter(versions.values())
    good = sorted(
        (v for v in confirmed_versions(versions) if v[0] >= minimum_step), key=lambda v: (counts[v], v), reverse=True
    )
    return [peer_id for version in good for peer_id, held in sorted(versions.items()) if held == version]
