"""Sends malformed and hostile messages to every protocol of a live peer; prints one JSON object.

A local swarm of one peer (stage 1 of 3, the target) is started; two clients that join its DHT send
`--messages` messages spread over the peer's protocols: an outsider, and a member (a peer with a
signed record on the target's stage, so its mate messages get past the membership check to the
checks behind it). Each message is drawn from a family of attacks:
random bytes, bad frame lengths, truncated frames, wrong fields (version, model, stage, kind),
shape overflows, NaN and huge values, absurd counts (samples, steps, attempts, ids) and foreign
member lists. Every `--health-every` messages (and at the end) the client checks the peer: it must
still run, answer its info, and return finite outputs for a sound forward. The report gives the
messages sent, replies by protocol and code, peer crashes, hangs (no reply within the frame
timeout plus a margin), INTERNAL replies (a bug: malformed input deserves BAD_REQUEST or similar),
the peer's resident memory at the start and the end, and the health checks passed. Each client sends
both over libp2p and over the direct data plane (past its handshake), and junk to the direct plane's
port in place of a handshake, which must be closed unserved. Every mate message
from the outsider, and every request of it for a standby copy, must be refused: `outsider_mate_ok`
counts those that were not.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from hivemind.p2p import P2P, PeerID

from swarm.compression import get_codec
from swarm.launch.local_swarm import LocalSwarm
from swarm.models import get_model_spec
from swarm.net.dht_node import TetheredDHT
from swarm.net.direct_handshake import HANDSHAKE_LIMITS
from swarm.net.direct_plane import DirectPlane, parse_direct_address
from swarm.net.identity import load_identity
from swarm.net.transport import (
    COMMIT_PROTOCOL,
    GRAD_PROTOCOL,
    INFO_PROTOCOL,
    PROGRESS_PROTOCOL,
    SLICE_PROTOCOL,
    STAGE_PROTOCOL,
    STANDBY_PROTOCOL,
    STATE_PROTOCOL,
    call_stage,
    get_peer_info,
)
from swarm.net.wire import HEADER_BYTES, Part, WireError, WireLimits, encode_tensor, pack_frames, read_frames
from swarm.proto import (
    BACKWARD,
    FORWARD,
    INFER,
    PROTOCOL_VERSION,
    DirectHello,
    ErrorCode,
    GradContribution,
    MateProgress,
    MateReply,
    PeerInfo,
    PeerInfoRequest,
    RoundCommit,
    RoundSlice,
    SampleId,
    StageReply,
    StageRequest,
    StateReply,
    StateRequest,
    Tensor,
)
from swarm.records.stage_records import JOINING, SERVING, StageRecord, announce, fetch_stage_records

MODEL, STAGE, NUM_STAGES = "gpt-tiny", 1, 3
SPEC = get_model_spec(MODEL)
SEQ, WIDTH = SPEC.seq_len, SPEC.boundary_width
FRAME_TIMEOUT = 60.0  # the peer's own (WireLimits.frame_timeout): a stalled request is cut off by then
HANG_MARGIN = 15.0
PROTOCOLS = {
    STAGE_PROTOCOL: StageReply,
    INFO_PROTOCOL: PeerInfo,
    GRAD_PROTOCOL: MateReply,
    PROGRESS_PROTOCOL: MateReply,
    COMMIT_PROTOCOL: MateReply,
    SLICE_PROTOCOL: MateReply,
    STATE_PROTOCOL: StateReply,
    STANDBY_PROTOCOL: StateReply,  # a holder's copy: answered only to a peer whose record is on the copy's stage
}


def framed(*messages) -> bytes:
    data = b""
    for message in messages:
        body = message.SerializeToString()
        data += len(body).to_bytes(HEADER_BYTES, "big") + body
    return data


def random_peer_id(rng: random.Random) -> str:
    alphabet = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
    return "12D3KooW" + "".join(rng.choice(alphabet) for _ in range(44))


def hostile_tensor(rng: random.Random) -> list[Part]:
    """One tensor's parts, broken in one of many ways (or sound in shape with hostile values)."""
    kinds = ["overflow", "negative", "zero_huge", "nan", "huge", "bad_dtype", "bad_codec", "parts", "short", "packed"]
    kind = rng.choice(kinds)
    if kind in ("nan", "huge"):
        value = float("nan") if kind == "nan" else 3e38
        return encode_tensor(torch.full((2, SEQ, WIDTH), value), get_codec("none"))
    head = Tensor(buffer=rng.randbytes(rng.randint(0, 64)), dtype="float32", codec="none", num_parts=1)
    if kind == "overflow":
        head.shape.extend([2**40, 2**40, 2**20])
    elif kind == "negative":
        head.shape.extend([2, -SEQ, WIDTH])
    elif kind == "zero_huge":
        head.shape.extend([0, 2**62, 2**62])
    elif kind == "bad_dtype":
        head.shape.extend([2, SEQ, WIDTH])
        head.dtype = rng.choice(["float128", "", "object", "complex64"])
    elif kind == "bad_codec":
        head.shape.extend([2, SEQ, WIDTH])
        head.codec = rng.choice(["zip", "../../etc", "fp8"])
    elif kind == "packed":  # integers packed with a junk type byte, or wider than the dtype they name
        head.shape.extend([2, SEQ])
        head.dtype = rng.choice(["int64", "int16", "float32"])
        head.codec = "packed-int"
        head.buffer = bytes([rng.choice([0, 3, 4, 5, 200])]) + rng.randbytes(rng.choice([0, 2 * SEQ, 16 * SEQ]))
    elif kind == "parts":
        head.shape.extend([2, SEQ, WIDTH])
        head.num_parts = rng.choice([2**31, 0, 7])
    else:  # a buffer shorter than its shape needs
        head.shape.extend([2, SEQ, WIDTH])
    buffer = head.buffer
    head.ClearField("buffer")
    return [Part(head, buffer)]


def absurd_ids(rng: random.Random) -> list[SampleId]:
    return [
        SampleId(trainer=random_peer_id(rng), microbatch=rng.getrandbits(64), samples=rng.choice([0, 2**32 - 1, 8]))
        for _ in range(rng.choice([1, 100, 70_000]))
    ]


def hostile_message(rng: random.Random, protocol: str, peer_step: int) -> tuple[bytes, bool]:
    """The bytes of one hostile message for `protocol`, and whether they are whole frames (a reply is due)."""
    if protocol == HANDSHAKE:
        return handshake_junk(rng), False
    family = rng.choice(["random", "length", "truncated", "fields", "tensors", "counts", "members"])
    if family == "random":
        return rng.randbytes(rng.randint(0, 4096)), False
    if family == "length":
        prefix = rng.choice([2**63, 2**40, 0, 5]).to_bytes(HEADER_BYTES, "big")
        return prefix + rng.randbytes(rng.randint(0, 64)), False
    # mostly right headers, so that most messages reach the checks behind them
    version = PROTOCOL_VERSION if rng.random() < 0.85 else rng.choice([PROTOCOL_VERSION + 1, 0])
    model = MODEL if rng.random() < 0.85 else rng.choice(["", "x" * 10_000])
    stage = STAGE if rng.random() < 0.85 else rng.choice([0, 2**32 - 1])
    step = rng.choice([peer_step, peer_step + 1, -1, 2**62])
    if protocol == STAGE_PROTOCOL:
        message = StageRequest(
            protocol_version=version, kind=rng.choice([FORWARD, BACKWARD, INFER, 7]), model=model, stage=stage,
            microbatch_id=rng.getrandbits(64), step=step, deadline_s=rng.choice([-1.0, 1e300, 5.0, float("nan")]),
            reply_codec=rng.choice(["", "none", "bogus"]),
            # inference sessions: names long and short, positions past the model's context, a drop with no tensors
            session=rng.choice(["", "s", "x" * 500]), position=rng.choice([0, 0, 1, 2**32 - 1]),
            end_session=rng.random() < 0.1,
        )  # fmt: skip
    elif protocol == INFO_PROTOCOL:
        message = PeerInfoRequest(protocol_version=version)
    elif protocol == GRAD_PROTOCOL:
        message = GradContribution(
            protocol_version=version, model=model, stage=stage, step=step, samples=rng.choice([2**64 - 1, 8, 0]),
            attempt=rng.choice([0, 1, 2**32 - 1]), give_up=rng.random() < 0.5, handover=rng.random() < 0.3,
        )  # fmt: skip
        if family == "members":
            message.members.extend(random_peer_id(rng) for _ in range(rng.choice([3, 300, 5000])))
        if family == "counts":
            message.held.extend(absurd_ids(rng))
    elif protocol == PROGRESS_PROTOCOL:
        message = MateProgress(
            protocol_version=version, model=model, stage=stage, step=step, samples=rng.choice([2**64 - 1, 8]),
            fingerprint=rng.choice(["", "0" * 16, "x" * 5000]),
        )  # fmt: skip
        if family == "counts":
            message.held.extend(absurd_ids(rng))
    elif protocol == COMMIT_PROTOCOL:
        message = RoundCommit(
            protocol_version=version, model=model, stage=stage, step=step, attempt=rng.choice([0, 1, 2**32 - 1])
        )
        message.contributors.extend(random_peer_id(rng) for _ in range(rng.choice([1, 300, 5000])))
    elif protocol == SLICE_PROTOCOL:
        message = RoundSlice(
            protocol_version=version, model=model, stage=stage, step=step, attempt=rng.choice([0, 1, 2**32 - 1]),
            kind=rng.choice([0, 1, 2, 3, 4, 99]), index=rng.choice([0, 1, 2**32 - 1]),
            count=rng.choice([0, 1, 2, 300, 2**32 - 1]), contributors=rng.randbytes(rng.choice([0, 16, 5000])),
        )  # fmt: skip
        if family == "counts":
            message.slice_norms.extend([float("nan"), -1.0] * rng.choice([1, 300]))
    else:
        message = StateRequest(protocol_version=version, model=model, stage=stage)
    if family == "tensors" and protocol in (STAGE_PROTOCOL, GRAD_PROTOCOL, SLICE_PROTOCOL):
        frames = pack_frames(message, [p for _ in range(rng.randint(1, 3)) for p in hostile_tensor(rng)])
        return framed(*frames), True
    data = framed(message)
    if family == "truncated":
        return data[: rng.randint(1, max(1, len(data) - 1))], False
    return data, True


async def send_raw(p2p: P2P, peer_id: PeerID, protocol: str, data: bytes, whole: bool, timeout: float) -> str:
    """Sends `data` on a fresh stream and reads the reply; returns the reply's code name or what happened.

    Bytes that are not whole frames are sent and the stream is closed at once ("sent"): the peer sees
    it end mid-message, as when a caller vanishes, and must neither crash nor hold on to anything.
    """
    try:  # the whole exchange is bounded: a peer that never opens the stream or never reads hangs too
        return await asyncio.wait_for(_exchange_raw(p2p, peer_id, protocol, data, whole), timeout)
    except asyncio.TimeoutError:
        return "hang"


async def _exchange_raw(p2p: P2P, peer_id: PeerID, protocol: str, data: bytes, whole: bool) -> str:
    _, reader, writer = await p2p.call_binary_stream_handler(peer_id, protocol)
    try:
        writer.write(data)
        await writer.drain()
        if not whole:
            return "sent"
        reply, _ = await read_frames(reader, PROTOCOLS[protocol], WireLimits())
        return ErrorCode.Name(reply.error.code)
    except WireError:
        return "closed"  # the peer hung up: fine for garbage
    except (ConnectionError, asyncio.IncompleteReadError):
        return "closed"
    finally:
        writer.close()


HANDSHAKE = "direct handshake"  # bytes to the direct plane's TCP port before (or instead of) a handshake
HANDSHAKE_TIMEOUT = HANDSHAKE_LIMITS.frame_timeout  # a silent sender is cut off after this


def handshake_junk(rng: random.Random) -> bytes:
    """Random bytes, a frame length too large, or a hello with fields out of their bounds or forged."""
    family = rng.choice(["random", "frame_length", "hello"])
    if family == "random":
        return rng.randbytes(rng.randint(1, 512))
    if family == "frame_length":
        return rng.choice([2**40, 2**20, 4097]).to_bytes(HEADER_BYTES, "big") + rng.randbytes(16)
    hello = DirectHello(
        protocol_version=rng.choice([PROTOCOL_VERSION, 0, 2**31]),
        protocol=rng.choice([STAGE_PROTOCOL, "x" * 200, "", "/nope"]),
        nonce=rng.randbytes(rng.choice([32, 0, 31])),
        public_key=rng.randbytes(rng.choice([0, 270, 2000])),
        ephemeral_key=rng.randbytes(rng.choice([32, 0, 7])),
        session=rng.randbytes(rng.choice([0, 16])),
    )
    data = hello.SerializeToString()
    frame = len(data).to_bytes(HEADER_BYTES, "big") + data
    return frame + rng.choice([b"", len(data).to_bytes(HEADER_BYTES, "big") + rng.randbytes(64)])


async def send_handshake_junk(address: tuple[str, int], data: bytes, timeout: float) -> str:
    """Sends `data` to the direct plane's port and waits for the peer to close: "closed", or "hang"."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(*address), timeout)
    except asyncio.TimeoutError:
        return "hang"
    try:
        writer.write(data)
        await asyncio.wait_for(writer.drain(), timeout)
        while await asyncio.wait_for(reader.read(2**16), timeout):
            pass
        return "closed"
    except asyncio.TimeoutError:
        return "hang"
    except (ConnectionError, asyncio.IncompleteReadError):
        return "closed"
    finally:
        writer.close()


def resident_mb(pid: int) -> float:
    """Resident memory of a process, MiB (0 if it is gone)."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


async def healthy(p2p: P2P, peer_id: PeerID) -> tuple[bool, str]:
    """Whether the peer answers its info and a sound forward with finite outputs."""
    try:
        info = await get_peer_info(p2p, peer_id, timeout=30)
        request = StageRequest(kind=FORWARD, model=MODEL, stage=STAGE, step=info.step)
        reply, outputs = await call_stage(p2p, peer_id, request, [torch.randn(2, SEQ, WIDTH)], get_codec("none"), 60)
    except Exception as e:
        return False, f"{type(e).__name__}: {e}"
    finite = len(outputs) == 1 and bool(torch.isfinite(outputs[0]).all())
    return finite, "" if finite else "non-finite outputs"


# the outsider has no record anywhere: none of these may answer it OK
MATE_PROTOCOLS = (GRAD_PROTOCOL, PROGRESS_PROTOCOL, COMMIT_PROTOCOL, SLICE_PROTOCOL, STATE_PROTOCOL, STANDBY_PROTOCOL)


def stage_member(initial_peers: list[str]) -> TetheredDHT:
    """A DHT node whose signed record says it joins the target's stage: the target takes it for a mate."""
    dht = TetheredDHT(initial_peers=initial_peers, start=True)
    record = StageRecord(str(dht.peer_id), STAGE, MODEL, NUM_STAGES, JOINING, 0, 0.0, 0, 1, 0, PROTOCOL_VERSION)
    if not announce(dht, "swarm", record, ttl=24 * 3600):
        raise SystemExit("could not announce the member's record")
    return dht


async def fuzz(
    args: argparse.Namespace,
    initial_peers: list[str],
    peer: tuple[str, str],
    alive: Callable[[], bool],
    pid: int,
    member: TetheredDHT,
):
    rng = random.Random(args.seed)
    peer_id, direct = peer
    outsider = load_identity(None)
    p2p = await P2P.create(initial_peers=initial_peers, identity_path=outsider.path)
    member_p2p = await member.replicate_p2p()
    # each sender both over libp2p and over the direct data plane (past its handshake, to the same handlers)
    senders = {
        "outsider": DirectPlane(p2p, outsider, dial=False),
        "member": DirectPlane(member_p2p, member.identity, dial=False),
        "outsider_direct": DirectPlane(p2p, outsider),
        "member_direct": DirectPlane(member_p2p, member.identity),
    }
    address = parse_direct_address(direct)
    if address is None:
        raise SystemExit(f"the target announces no direct address ({direct!r})")
    for name in ("outsider_direct", "member_direct"):
        senders[name].addresses[peer_id] = address
    target = PeerID.from_base58(peer_id)
    replies: dict[str, Counter[str]] = {protocol: Counter() for protocol in [*PROTOCOLS, HANDSHAKE]}
    by_sender: dict[str, Counter[str]] = {sender: Counter() for sender in senders}
    outsider_mate_ok = 0
    report: dict[str, Any] = {"memory_start_mb": round(resident_mb(pid), 1), "health_failures": []}
    checks = passed = sent = 0
    started = time.monotonic()
    try:
        step = (await get_peer_info(p2p, target)).step
        while sent < args.messages and alive():
            batch = min(args.concurrency, args.messages - sent)
            protocols = [rng.choice([*PROTOCOLS, HANDSHAKE]) for _ in range(batch)]
            who = [rng.choice(list(senders)) for _ in range(batch)]
            messages = [hostile_message(rng, protocol, step) for protocol in protocols]
            timeout = FRAME_TIMEOUT + HANG_MARGIN
            outcomes = await asyncio.gather(
                *(
                    send_raw(senders[sender], target, p, data, whole, timeout)
                    if p != HANDSHAKE
                    else send_handshake_junk(address, data, HANDSHAKE_TIMEOUT + HANG_MARGIN)
                    for sender, p, (data, whole) in zip(who, protocols, messages)
                ),
                return_exceptions=True,
            )
            for sender, protocol, outcome in zip(who, protocols, outcomes):
                code = outcome if isinstance(outcome, str) else f"error:{type(outcome).__name__}"
                replies[protocol][code] += 1
                by_sender[sender][code] += 1
                outsider = sender.startswith("outsider")
                outsider_mate_ok += outsider and protocol in MATE_PROTOCOLS and code == "OK"
            sent += batch
            if sent // args.health_every != (sent - batch) // args.health_every or sent >= args.messages:
                checks += 1
                ok, why = await healthy(p2p, target)
                passed += ok
                if not ok:
                    report["health_failures"].append({"after": sent, "why": why})
                print(f"{sent} messages sent; health {'ok' if ok else why}", file=sys.stderr)
    finally:
        await p2p.shutdown()
    everything = Counter()
    for counts in replies.values():
        everything.update(counts)
    report.update(
        messages=sent,
        seconds=round(time.monotonic() - started, 1),
        replies_by_protocol={protocol: dict(counts) for protocol, counts in replies.items()},
        replies_by_sender={sender: dict(counts) for sender, counts in by_sender.items()},
        outsider_mate_ok=outsider_mate_ok,
        replies=dict(everything),
        internal_replies=everything["INTERNAL"],
        hangs=everything["hang"],
        health_checks=checks,
        health_passed=passed,
    )
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=10_000, help="hostile messages to send")
    parser.add_argument("--health-every", type=int, default=500, help="messages between health checks")
    parser.add_argument("--concurrency", type=int, default=8, help="messages in flight at once")
    parser.add_argument("--seed", type=int, default=0, help="seed of the message choices")
    args = parser.parse_args()
    if args.messages < 1 or args.health_every < 1 or args.concurrency < 1:
        parser.error("--messages, --health-every and --concurrency must be at least 1")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a timeout still stops the swarm
    workdir = Path(tempfile.mkdtemp(prefix="fuzz-"))
    with LocalSwarm(workdir) as swarm:
        swarm.start_bootstrap()
        process = swarm.start_peer("target", STAGE, ["--model", MODEL, "--num-stages", str(NUM_STAGES)])
        dht = TetheredDHT(initial_peers=swarm.initial_peers, start=True)
        try:
            deadline = time.monotonic() + 120
            while not any(r.state == SERVING for r in fetch_stage_records(dht, "swarm", NUM_STAGES)[STAGE]):
                if process.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the peer did not come up; see {swarm.log_path('target')}")
                time.sleep(0.5)
            record = next(iter(fetch_stage_records(dht, "swarm", NUM_STAGES)[STAGE]))
            peer_id, direct = record.peer_id, record.direct
        finally:
            dht.shutdown()
        member = stage_member(swarm.initial_peers)
        try:
            alive = lambda: process.poll() is None  # noqa: E731
            target = (peer_id, direct)
            report = asyncio.run(fuzz(args, swarm.initial_peers, target, alive, process.pid, member))
        finally:
            member.shutdown()
        report["peer_crashed"] = process.poll() is not None
        report["memory_end_mb"] = round(resident_mb(process.pid), 1)
        report["memory_growth_mb"] = round(report["memory_end_mb"] - report["memory_start_mb"], 1)
        report["log"] = str(swarm.log_path("target"))
    report["healthy_at_end"] = not report["peer_crashed"] and report["health_passed"] == report["health_checks"]
    print(json.dumps(report))
    bad = report["peer_crashed"] or report["hangs"] or report["internal_replies"] or not report["healthy_at_end"]
    bad = bad or report["outsider_mate_ok"]
    sys.exit(1 if bad or not math.isfinite(report["memory_growth_mb"]) else 0)


if __name__ == "__main__":
    main()
