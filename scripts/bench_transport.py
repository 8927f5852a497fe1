"""Echo of a tensor through libp2p, the direct data plane and a raw TCP socket; prints one JSON object.

A server process answers each call with the tensor it was sent. On libp2p and on the direct plane the
call is what a stage call is: the tensor encoded (codec none), cut into 512 KiB parts, framed, sent,
read back and decoded by `swarm.net.transport.exchange`, with the direct plane's handshake (resumed
after the first call) on each call. Raw TCP sends the bare bytes over one open connection: the
ceiling for the machine. The paths take turns, one call each per round. Reported per size and path: the
median round trip and GB/s, counted as the tensor's bytes each way (2 x size / round trip), the GB/s of
the fastest round, the CPU both processes spent per round trip (and the GB/s that alone would allow), and
the ratio to raw TCP in the same run.

The direct plane is measured both ways it carries tensors between two processes of one host: `direct`
(through shared memory, the socket carrying only the sealed frames that name them) and `direct_tcp`
(every byte through the socket, sealed: what crosses a network). `--plain-baseline` adds the same two
paths with the frames not sealed (`direct_plain`, `direct_tcp_plain`: planes built for this comparison
only, which a swarm cannot be), and `--tls` the TLS alternatives of `scripts/harness/tls_echo.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import sys
import time
from pathlib import Path

import torch
from hivemind.p2p import P2P, PeerID

from swarm.compression import get_codec
from swarm.net.direct_plane import DirectPlane, DirectServer, parse_direct_address
from swarm.net.identity import load_identity
from swarm.net.transport import exchange
from swarm.net.wire import (
    WireLimits,
    decode_tensors,
    encode_tensor,
    pack_frames,
    read_frames,
    wait_for_hang_up,
    write_frames,
)
from swarm.process.allocator import keep_large_buffers
from swarm.process.event_loop import run
from swarm.proto import StageReply, StageRequest

ECHO_PROTOCOL = "/swarm/bench/echo"
LIMITS = WireLimits(max_message_bytes=2**30, max_tensor_bytes=2**30)


async def _echo(_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    _, parts = await read_frames(reader, StageRequest, LIMITS)
    await write_frames(writer, pack_frames(StageReply(), parts))
    await wait_for_hang_up(reader)
    writer.close()


async def _raw_echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with_size = True
    while with_size:
        try:
            size = int.from_bytes(await reader.readexactly(8), "big")
        except asyncio.IncompleteReadError:
            break
        writer.write(size.to_bytes(8, "big"))
        while size:
            chunk = await reader.read(min(size, 2**22))
            if not chunk:
                return
            writer.write(chunk)
            size -= len(chunk)
        await writer.drain()
    writer.close()


async def _serve(connection) -> None:
    identity = load_identity(None)
    p2p = await P2P.create(identity_path=identity.path)
    plane = DirectPlane(p2p, identity)
    await plane.add_binary_stream_handler(ECHO_PROTOCOL, _echo)
    direct = await plane.serve("127.0.0.1", 0, "127.0.0.1")
    plain = DirectServer(identity, arenas=plane.arenas, cipher="")  # the unsealed baseline: this bench only
    plain.handlers[ECHO_PROTOCOL] = _echo
    plain_port = await plain.start("127.0.0.1", 0)
    raw = await asyncio.start_server(_raw_echo, "127.0.0.1", 0, limit=2**22)
    maddrs = [str(m) for m in await p2p.get_visible_maddrs()]
    served = (maddrs, p2p.peer_id.to_base58(), direct, f"127.0.0.1:{plain_port}", raw.sockets[0].getsockname()[1])
    connection.send(served)
    await asyncio.get_running_loop().run_in_executor(None, _answer, connection)  # until told to stop
    await plain.close()
    await plane.shutdown()


def _answer(connection) -> None:
    """Tells the bench this process's CPU seconds so far, whenever it asks, until it says stop."""
    while connection.recv() == "cpu":
        connection.send(time.process_time())


def serve(connection) -> None:
    torch.set_num_threads(1)
    keep_large_buffers()
    run(_serve(connection))


async def _echo_call(net, peer_id: PeerID, tensor: torch.Tensor) -> None:
    frames = pack_frames(StageRequest(), encode_tensor(tensor, get_codec("none")))
    _, parts = await exchange(net, peer_id, ECHO_PROTOCOL, frames, StageReply, LIMITS)
    (echoed,) = decode_tensors(parts, LIMITS)
    assert echoed.shape == tensor.shape


async def _measure(paths: dict, repeats: int, server_cpu) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Round trips of each path, the paths taking turns (one call each per round, in an order that rotates): a
    machine whose load changes during the run slows them alike. Also the CPU seconds each call took, this
    process's and the server's (`server_cpu()`) together: what the path costs, however busy the machine."""
    for call in paths.values():
        await call()  # warm-up: connections, sessions, buffers
    times: dict[str, list[float]] = {name: [] for name in paths}
    cpu: dict[str, list[float]] = {name: [] for name in paths}
    names = list(paths)
    for round_number in range(repeats):
        # each round starts with the next path: none always follows the same one (libp2p's daemons, say)
        for name in names[round_number % len(names) :] + names[: round_number % len(names)]:
            call = paths[name]
            cpu_before = time.process_time() + server_cpu()
            started = time.perf_counter()
            await call()
            times[name].append(time.perf_counter() - started)
            cpu[name].append(time.process_time() + server_cpu() - cpu_before)
    return times, cpu


async def _run(args, served, server_cpu) -> dict:
    maddrs, peer, direct, plain, raw_port = served
    identity = load_identity(None)
    p2p = await P2P.create(identity_path=identity.path, initial_peers=maddrs)
    peer_id = PeerID.from_base58(peer)
    planes = {
        "libp2p": DirectPlane(p2p, identity, dial=False),
        "direct": DirectPlane(p2p, identity),
        "direct_tcp": DirectPlane(p2p, identity, shared_memory=False),
    }
    if args.plain_baseline:
        planes["direct_plain"] = DirectPlane(p2p, identity, cipher="")
        planes["direct_tcp_plain"] = DirectPlane(p2p, identity, shared_memory=False, cipher="")
    for name, plane in planes.items():
        plane.addresses[peer] = parse_direct_address(plain if name.endswith("_plain") else direct)
    reader, writer = await asyncio.open_connection("127.0.0.1", raw_port, limit=2**22)

    async def raw_call(data: bytes) -> None:
        writer.write(len(data).to_bytes(8, "big"))
        writer.write(data)
        size = int.from_bytes(await reader.readexactly(8), "big")
        await reader.readexactly(size)

    results = []
    for size_mib in args.sizes_mib:
        tensor = torch.randn(size_mib * 2**18)  # float32: 4 bytes each
        data = tensor.numpy().tobytes()
        repeats = max(3, args.repeats * 4 // size_mib) if size_mib > 4 else args.repeats
        paths = {
            name: lambda plane=plane, tensor=tensor: _echo_call(plane, peer_id, tensor)
            for name, plane in planes.items()
        }
        paths["raw_tcp"] = lambda data=data: raw_call(data)
        row: dict = {"size_mib": size_mib, "repeats": repeats}
        times, cpu = await _measure(paths, repeats, server_cpu)
        for name in paths:
            median, cpu_median = statistics.median(times[name]), statistics.median(cpu[name])
            row[name] = {
                "round_trip_ms": round(median * 1e3, 2),
                "gb_per_s": round(2 * len(data) / median / 1e9, 3),
                # the fastest round: on a machine other work shares, what the path does when it gets the cores
                "best_gb_per_s": round(2 * len(data) / min(times[name]) / 1e9, 3),
                # CPU of both ends per round trip (libp2p's: not counting its daemons), and the GB/s of a round
                # trip that took only that: the path's cost, which other work on the machine hardly changes
                "cpu_ms": round(cpu_median * 1e3, 2),
                "cpu_bound_gb_per_s": round(2 * len(data) / cpu_median / 1e9, 3),
            }
        for name in planes:
            row[name]["vs_raw_tcp"] = round(row[name]["gb_per_s"] / row["raw_tcp"]["gb_per_s"], 3)
        row["direct_vs_libp2p"] = round(row["direct"]["gb_per_s"] / row["libp2p"]["gb_per_s"], 2)
        results.append(row)
    for name, plane in planes.items():
        if name != "libp2p":
            assert plane.calls["direct_failed"] == 0 and plane.calls["libp2p"] == 0, (name, plane.calls)
    assert planes["direct"].calls["shared_memory"] and not planes["direct_tcp"].calls["shared_memory"]
    writer.close()
    await p2p.shutdown()
    return {"results": results, "direct_calls": planes["direct"].calls["direct"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[4, 64], help="tensor sizes, MiB")
    parser.add_argument("--repeats", type=int, default=20, help="echoes per path at 4 MiB (fewer for larger)")
    parser.add_argument(
        "--plain-baseline", action="store_true", help="also the direct plane with its frames not sealed, as before"
    )
    parser.add_argument("--tls", action="store_true", help="also the TLS alternatives (grpcio, Python's ssl) at 4 MiB")
    args = parser.parse_args()
    torch.set_num_threads(1)
    keep_large_buffers()
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    server = context.Process(target=serve, args=(theirs,), daemon=True)
    server.start()
    try:
        if not ours.poll(60):
            raise SystemExit("the echo server did not start within 60 s")
        served = ours.recv()

        def server_cpu() -> float:
            ours.send("cpu")
            return ours.recv()

        report = run(_run(args, served, server_cpu))
    finally:
        ours.send("stop")
        server.join(10)
        if server.is_alive():
            server.kill()
    if args.tls:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from harness.tls_echo import measure

        report["tls_4_mib"] = measure(4, args.repeats)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
