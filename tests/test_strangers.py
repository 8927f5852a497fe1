"""Strangers on the network, against real processes: outsiders cannot speak as stage-mates, a lying mate
cannot take a stage over with a forged step, and a private swarm serves nobody outside its allowlist."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch
from conftest import (
    METRICS_LINE,
    metric,
    model_flags,
    run_as_stage_members,
    run_p2p_client,
    trainer_flags,
    wait_for_records,
)
from hivemind.p2p import PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure
from hivemind.utils import get_dht_time

from swarm.compression import get_codec
from swarm.models import build_stage, get_model_spec
from swarm.models.optimizer import OptimizerSettings, build_optimizer
from swarm.net.dht_node import TetheredDHT
from swarm.net.identity import load_identity
from swarm.net.transport import (
    COMMIT_PROTOCOL,
    GRAD_PROTOCOL,
    INFO_PROTOCOL,
    PROGRESS_PROTOCOL,
    STAGE_PROTOCOL,
    STATE_PROTOCOL,
    StageCallError,
    exchange,
    get_peer_info,
)
from swarm.net.wire import WireLimits, encode_tensor, pack_frames, read_frames, wait_for_hang_up, write_frames
from swarm.peer.stage_state import parameter_fingerprint, state_tensors
from swarm.proto import (
    PROTOCOL_VERSION,
    ErrorCode,
    GradContribution,
    MateProgress,
    MateReply,
    PeerInfo,
    PeerInfoRequest,
    RoundCommit,
    SampleId,
    StageReply,
    StateReply,
    StateRequest,
)
from swarm.records.stage_records import SERVING, StageRecord, announce, fetch_stage_records, stage_key

NONE = get_codec("none")
FLAGS = [*model_flags(), "--target-batch-size", "16", "--announce-period", "0.5"]


def serving(counts: list[int]):
    return lambda records: [sum(r.state == SERVING for r in records[s]) for s in range(3)] == counts


def stage1_peer_ids(initial_peers: list[str]) -> list[str]:
    """Stage 1's serving peers, once there is one (a peer announces itself joining before it serves)."""

    def serving_at_1(records) -> list[str]:
        return [r.peer_id for r in records[1] if r.state == SERVING]

    return serving_at_1(wait_for_records(initial_peers, serving_at_1))


def mate_messages(step: int) -> list[tuple[str, object, type]]:
    """One message of each mate protocol, as a mate at `step` would send it, with a gradient of the right size."""
    module = build_stage(get_model_spec("gpt-tiny"), 1, 3, seed=0)
    size = sum(p.numel() for p in module.parameters())
    held = [SampleId(trainer="12D3KooWHC2fW5dayrHQFixWeqLUbXSpBFYcsCEGbpuJWffMLvEE", microbatch=1, samples=4)]
    head = {"protocol_version": PROTOCOL_VERSION, "model": "gpt-tiny", "stage": 1, "step": step}
    contribution = GradContribution(**head, samples=4, held=held, members=[])
    return [
        (PROGRESS_PROTOCOL, [MateProgress(**head, samples=4, held=held)], MateReply),
        (GRAD_PROTOCOL, pack_frames(contribution, encode_tensor(torch.full((size,), 1e3), NONE)), MateReply),
        (COMMIT_PROTOCOL, [RoundCommit(**head, contributors=[])], MateReply),
        (STATE_PROTOCOL, [StateRequest(protocol_version=PROTOCOL_VERSION, model="gpt-tiny", stage=1)], StateReply),
    ]


@pytest.mark.timeout(240)
def test_an_outsiders_gradient_progress_commit_and_state_request_are_refused(local_swarm):
    local_swarm.start_bootstrap()
    local_swarm.start_peer("peer1", 1, FLAGS)
    (peer_id,) = stage1_peer_ids(local_swarm.initial_peers)
    peer = PeerID.from_base58(peer_id)

    async def as_outsider(p2p):
        before = await get_peer_info(p2p, peer)
        codes = []
        for protocol, frames, reply_type in mate_messages(before.step):
            reply, parts = await exchange(p2p, peer, protocol, frames, reply_type, WireLimits())
            codes.append((protocol, ErrorCode.Name(reply.error.code), len(parts)))
        return before, codes, await get_peer_info(p2p, peer)

    before, codes, after = run_p2p_client(local_swarm.initial_peers, as_outsider)
    assert all(code == "FORBIDDEN" and parts == 0 for _, code, parts in codes), codes
    assert after.refused_outsiders == before.refused_outsiders + 4
    # nothing the outsider sent counts: no samples, no round, no state given away
    assert (after.step, after.fingerprint, after.samples_accumulated) == (before.step, before.fingerprint, 0)
    assert after.step_state == "accumulating"

    async def as_member(p2p):  # the same progress from a peer whose signed record puts it on stage 1 is heard
        protocol, frames, reply_type = mate_messages(after.step)[0]
        reply, _ = await exchange(p2p, peer, protocol, frames, reply_type, WireLimits())
        return reply.error.code

    assert run_as_stage_members(local_swarm.initial_peers, 1, 1, as_member) == ErrorCode.OK


class Liar:
    """A stranger with a valid, signed record on stage 1 that claims step 1000 and serves a state of its own.

    It answers info and state requests like a mate that ran ahead; peers that trusted the record alone
    would take its parameters, a whole stage taken over by one record.
    """

    STEP = 1000

    def __init__(self, initial_peers: list[str]) -> None:
        self.dht = TetheredDHT(initial_peers=initial_peers, start=True)
        module = build_stage(get_model_spec("gpt-tiny"), 1, 3, seed=1234)
        self.fingerprint = parameter_fingerprint(module)
        tensors, _ = state_tensors(module, build_optimizer(module, OptimizerSettings()))
        self.parts = [part for t in tensors for part in encode_tensor(t, NONE)]
        self.states_given = 0

    def announce(self) -> None:
        record = StageRecord(str(self.dht.peer_id), 1, "gpt-tiny", 3, SERVING, self.STEP, 500.0, 0, 16, 0, 4)
        assert announce(self.dht, "swarm", record, ttl=600)

    async def serve(self) -> None:
        p2p = await self.dht.replicate_p2p()
        await p2p.add_binary_stream_handler(INFO_PROTOCOL, self._info)
        await p2p.add_binary_stream_handler(STATE_PROTOCOL, self._state)

    async def _answer(self, reader, writer, frames) -> None:
        await write_frames(writer, frames)
        await wait_for_hang_up(reader)
        writer.close()

    async def _info(self, _info, reader, writer) -> None:
        await read_frames(reader, PeerInfoRequest, WireLimits())
        info = PeerInfo(
            protocol_version=PROTOCOL_VERSION, model="gpt-tiny", stage=1, num_stages=3, step=self.STEP,
            fingerprint=self.fingerprint, state=SERVING, throughput=500.0,
        )  # fmt: skip
        await self._answer(reader, writer, [info])

    async def _state(self, _info, reader, writer) -> None:
        await read_frames(reader, StateRequest, WireLimits())
        self.states_given += 1
        reply = StateReply(protocol_version=PROTOCOL_VERSION, step=self.STEP, has_optimizer_state=False)
        await self._answer(reader, writer, pack_frames(reply, self.parts))


@pytest.mark.timeout(300)
def test_a_forged_record_with_a_high_step_is_not_taken(local_swarm, tmp_path):
    """Stage 1 has two honest peers. A liar announces step 1000 there (and a forger writes a record in an
    honest peer's name): neither the honest peers nor a newcomer take the liar's state, training goes on."""
    local_swarm.start_bootstrap()
    for name, stage in (("peer0", 0), ("peer1a", 1), ("peer1b", 1), ("peer2", 2)):
        local_swarm.start_peer(name, stage, FLAGS)
    wait_for_records(local_swarm.initial_peers, serving([1, 2, 1]))
    honest = stage1_peer_ids(local_swarm.initial_peers)
    liar = Liar(local_swarm.initial_peers)
    try:
        liar.announce()
        forged = StageRecord(honest[0], 1, "gpt-tiny", 3, SERVING, Liar.STEP, 500.0, 0, 16, 0, 4).to_value()
        # nodes that check records' signatures refuse it; whether any node keeps it (the liar's own may) depends on
        # which nodes the store reaches, so its outcome is not asserted: kept or not, it must not be taken
        liar.dht.store(stage_key("swarm", 1), forged, get_dht_time() + 600, subkey=honest[0])

        async def scenario(p2p):
            await liar.serve()
            loop = asyncio.get_running_loop()
            summary = tmp_path / "summary.json"
            flags = [*trainer_flags(4, summary, microbatch_size=4), "--call-timeout-floor", "5"]
            trainer = local_swarm.start_trainer("trainer", flags)
            assert await loop.run_in_executor(None, trainer.wait, 240) == 0, "the trainer did not finish"
            local_swarm.start_peer("peer1c", 1, FLAGS)
            deadline = time.monotonic() + 120
            while True:
                records = await loop.run_in_executor(None, fetch_stage_records, liar.dht, "swarm", 3)
                newcomer = [r.peer_id for r in records[1] if r.state == SERVING and r.peer_id not in honest]
                newcomer = [p for p in newcomer if p != str(liar.dht.peer_id)]
                if newcomer:
                    break
                assert time.monotonic() < deadline, "the newcomer never served"
                await asyncio.sleep(0.5)
            return [await get_peer_info(p2p, PeerID.from_base58(p)) for p in [*honest, *newcomer]]

        infos = run_p2p_client(local_swarm.initial_peers, scenario)
    finally:
        liar.dht.shutdown()
    steps = [info.step for info in infos]
    assert steps[0] >= 4 and len(set(steps)) == 1, f"stage 1 peers at steps {steps}, the liar claims {Liar.STEP}"
    assert len({info.fingerprint for info in infos}) == 1, "the newcomer took a state the honest mates do not hold"
    assert liar.fingerprint not in {info.fingerprint for info in infos}
    assert [info.resyncs for info in infos[:2]] == [0, 0], "an honest peer resynced toward the liar"


def identities(directory: Path, names: list[str]) -> dict[str, str]:
    """Key files for `names` (made now); returns name -> peer id."""
    directory.mkdir()
    return {name: load_identity(str(directory / f"{name}.key")).peer_id for name in names}


@pytest.mark.timeout(300)
def test_a_private_swarm_serves_nothing_to_a_peer_outside_its_allowlist(local_swarm, tmp_path):
    members = ["bootstrap", "peer0", "peer1", "peer2", "trainer", "reader"]
    ids = identities(tmp_path / "keys", members)
    allowlist = tmp_path / "allowlist.txt"
    allowlist.write_text("# the lab's machines\n" + "".join(f"{ids[n]}  # {n}\n" for n in members))

    def own(name: str) -> list[str]:
        return ["--identity-path", str(tmp_path / "keys" / f"{name}.key"), "--allowlist", str(allowlist)]

    local_swarm.start_bootstrap(own("bootstrap"))
    for stage in range(3):
        local_swarm.start_peer(f"peer{stage}", stage, [*FLAGS, *own(f"peer{stage}")])
    summary = tmp_path / "summary.json"
    trainer = local_swarm.start_trainer("trainer", [*trainer_flags(2, summary, microbatch_size=4), *own("trainer")])

    outsider = TetheredDHT(initial_peers=local_swarm.initial_peers, start=True)  # a stranger with no list
    reader_identity = load_identity(str(tmp_path / "keys" / "reader.key"))
    from swarm.net.allowlist import Allowlist

    reader = TetheredDHT(
        initial_peers=local_swarm.initial_peers,
        identity=reader_identity,
        allowlist=Allowlist.read(str(allowlist)),
        start=True,
    )
    try:
        record = StageRecord(str(outsider.peer_id), 1, "gpt-tiny", 3, SERVING, 0, 1e6, 0, 16, 0, PROTOCOL_VERSION)
        announce(outsider, "swarm", record, ttl=600)  # a fast peer on stage 1: it would draw the trainer's calls
        deadline = time.monotonic() + 90
        while not all(any(r.state == SERVING for r in rs) for rs in fetch_stage_records(reader, "swarm", 3).values()):
            assert time.monotonic() < deadline, "the private swarm did not come up"
            time.sleep(0.3)
        stage1 = fetch_stage_records(reader, "swarm", 3)[1]
        assert [r.peer_id for r in stage1] == [ids["peer1"]], "a member read the outsider's record"
        assert trainer.wait(180) == 0, local_swarm.log_path("trainer").read_text()[-3000:]

        async def ask(p2p):
            answers = []
            for protocol, frames, reply_type in mate_messages(0)[:1]:
                try:
                    await exchange(p2p, PeerID.from_base58(ids["peer1"]), protocol, frames, reply_type, WireLimits())
                    answers.append(protocol)
                except Exception:
                    pass
            try:
                await get_peer_info(p2p, PeerID.from_base58(ids["peer1"]), timeout=10)
                answers.append(INFO_PROTOCOL)
            except StageCallError:
                pass
            return answers

        async def as_outsider(_):
            return await ask(await outsider.replicate_p2p())

        async def as_member(_):
            return await ask(await reader.replicate_p2p())

        assert run_p2p_client(local_swarm.initial_peers, as_outsider) == [], "an outsider was served"
        assert INFO_PROTOCOL in run_p2p_client(local_swarm.initial_peers, as_member), "a member was refused"
    finally:
        outsider.shutdown()
        reader.shutdown()
    assert "not in --allowlist" in local_swarm.log_path("peer1").read_text()


def open_streams(url: str) -> float:
    """The peer's own count of streams open now (its gate's)."""
    return metric(url, "swarm_peer_open_streams")


def lone_stage1_peer(local_swarm, *flags: str) -> PeerID:
    """Starts a bootstrap and peer1 alone on stage 1 with `flags`; returns its peer id once it serves."""
    local_swarm.start_bootstrap()
    local_swarm.start_peer("peer1", 1, [*FLAGS, *flags])
    (peer_id,) = stage1_peer_ids(local_swarm.initial_peers)
    return PeerID.from_base58(peer_id)


@pytest.mark.timeout(180)
def test_a_caller_holding_too_many_streams_open_is_turned_away_and_served_again_once_it_closes_them(local_swarm):
    peer = lone_stage1_peer(local_swarm, "--max-streams-per-caller", "3", "--metrics-port", "0")
    log = local_swarm.log_path("peer1")
    url = METRICS_LINE.search(log.read_text()).group(1)  # logged before the record is announced

    async def wait_for_open_streams(count: int) -> float:
        """Waits (at most 60 s) until the peer counts `count` open streams; returns its last count."""
        deadline = asyncio.get_running_loop().time() + 60
        while (found := await asyncio.to_thread(open_streams, url)) != count:
            if asyncio.get_running_loop().time() > deadline:
                break
            await asyncio.sleep(0.1)
        return found

    async def go(p2p):
        assert (await get_peer_info(p2p, peer)).stage == 1
        assert await wait_for_open_streams(0) == 0, "the first call's stream stayed open"
        held = []
        for _ in range(3):  # each begins a frame and never finishes it: the peer waits on all three
            _, _, writer = await p2p.call_binary_stream_handler(peer, STAGE_PROTOCOL)
            writer.write(b"\0\0\0")
            await writer.drain()
            held.append(writer)
        # the peer counts a stream once its handler starts, which a loaded machine can delay
        counted = await wait_for_open_streams(3)
        assert counted == 3, f"the peer counts {counted} of the 3 streams held open:\n{log.read_text()[-3000:]}"
        with pytest.raises(StageCallError) as refused:
            await get_peer_info(p2p, peer, timeout=10)
        for writer in held:
            writer.close()
        # the held streams end on the peer's side too: it serves this caller again
        assert await wait_for_open_streams(0) == 0, "the closed streams stayed open on the peer"
        # calls cut off mid-request are cancelled calls, counted as abandoned, not as bad requests answered
        assert await asyncio.to_thread(metric, url, "swarm_peer_abandoned_calls_total") == 3
        assert await asyncio.to_thread(metric, url, "swarm_peer_errors_total", protocol=STAGE_PROTOCOL) == 0
        return refused.value.code, (await get_peer_info(p2p, peer, timeout=10)).stage

    assert run_p2p_client(local_swarm.initial_peers, go) == (ErrorCode.UNAVAILABLE, 1)
    assert "over --max-streams-per-caller" in log.read_text()


@pytest.mark.timeout(180)
def test_requests_held_over_all_callers_stay_within_the_budget_and_its_bytes_come_back(local_swarm):
    # --max-request-mb 1: the budget is two of the largest requests (--request-memory-mb asks for less)
    peer = lone_stage1_peer(local_swarm, "--max-request-mb", "1", "--request-memory-mb", "0.01")
    frame = 2**20 - 64  # within one request's limit: the peer takes its bytes from the budget, then waits for them

    async def announce_frame(p2p):
        deadline = asyncio.get_running_loop().time() + 30
        while True:  # a fresh client finds the peer by id once its daemon's routing table holds a peer
            try:
                _, reader, writer = await p2p.call_binary_stream_handler(peer, STAGE_PROTOCOL)
                break
            except ControlFailure as e:
                if "failed to find any peer" not in str(e) or asyncio.get_running_loop().time() > deadline:
                    raise
                await asyncio.sleep(0.2)
        writer.write(frame.to_bytes(8, "big"))
        await writer.drain()
        return reader, writer

    async def go(p2p):
        # three callers' frames, two of which fill the budget: whichever the peer reads last is refused at once
        streams = [await announce_frame(p2p) for _ in range(3)]
        replies = [asyncio.ensure_future(read_frames(reader, StageReply, WireLimits())) for reader, _ in streams]
        done, pending = await asyncio.wait(replies, timeout=30, return_when=asyncio.FIRST_COMPLETED)
        assert len(done) == 1, f"{len(done)} of the 3 streams answered within 30 s"
        refused, _ = done.pop().result()
        for task in pending:
            task.cancel()
        for _, held_writer in streams:  # their streams end: the bytes they held come back
            held_writer.close()
        deadline = asyncio.get_running_loop().time() + 30
        while True:  # a request of the same size is taken again (its body then fails to parse: BAD_REQUEST)
            reader, writer = await announce_frame(p2p)
            writer.write(bytes(frame))
            await writer.drain()
            again, _ = await asyncio.wait_for(read_frames(reader, StageReply, WireLimits()), 30)
            writer.close()
            if again.error.code != ErrorCode.UNAVAILABLE or asyncio.get_running_loop().time() > deadline:
                return refused.error, again.error
            await asyncio.sleep(0.2)

    refused, again = run_p2p_client(local_swarm.initial_peers, go)
    assert refused.code == ErrorCode.UNAVAILABLE, refused
    assert "this peer is busy: it holds 2.0 MiB of requests" in refused.message, refused
    assert again.code == ErrorCode.BAD_REQUEST, again
