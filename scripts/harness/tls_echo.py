"""The TLS alternatives to the direct plane's sealed frames, measured as `scripts/bench_transport.py` measures
the direct plane: the echo of a tensor's bytes in GB/s (2 x size / round trip), and the CPU both ends spent on
it. Prints one JSON object.

Four echo servers run in one child process, each answering a 4 MiB message (sent as 512 KiB pieces, as the
wire cuts tensors) with the same bytes:
- `grpc_mtls`: grpcio over mutual TLS, each side's certificate self-signed with its RSA identity key (the
  certificates a swarm would bind to its peer ids), a bidirectional stream of the pieces;
- `grpc_insecure`: the same grpcio stream without TLS, to tell grpc's own cost from TLS's;
- `asyncio_tls`: Python's `ssl` (OpenSSL, TLS 1.3) on an asyncio connection, the way TLS would wrap the
  direct plane's own socket;
- `asyncio_tcp`: the same connection without TLS.

grpcio authenticates a client only against root certificates it holds before the call: a swarm of
self-signed identity certificates would need a certificate authority per swarm, or a second proof of the
key inside the TLS channel. The figures here are for the wire only; see docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import multiprocessing
import ssl
import statistics
import tempfile
import time
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.x509.oid import NameOID

from swarm.net.identity import Identity, load_identity

PIECE = 512 * 1024
ECHO_METHOD = "/swarm.bench.Echo/Stream"
GRPC_OPTIONS = [("grpc.max_receive_message_length", 2**27), ("grpc.max_send_message_length", 2**27)]


def certificate(identity: Identity) -> tuple[bytes, bytes]:
    """(certificate PEM, key PEM): an X.509 certificate of the identity's RSA key, self-signed, named by its peer id."""
    key = identity.key._private_key
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, identity.peer_id)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


async def _grpc_echo(requests, _context):
    async for piece in requests:
        yield piece


async def _tcp_echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            size = int.from_bytes(await reader.readexactly(8), "big")
            writer.write(size.to_bytes(8, "big"))
            writer.write(await reader.readexactly(size))
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()


async def _serve(connection, client_cert: bytes) -> None:
    server_cert, server_key = certificate(load_identity(None))
    handler = grpc.method_handlers_generic_handler(
        "swarm.bench.Echo", {"Stream": grpc.stream_stream_rpc_method_handler(_grpc_echo)}
    )
    ports = {}
    servers = []
    for name, credentials in (
        ("grpc_mtls", grpc.ssl_server_credentials([(server_key, server_cert)], client_cert, True)),
        ("grpc_insecure", None),
    ):
        server = grpc.aio.server(options=GRPC_OPTIONS)
        server.add_generic_rpc_handlers((handler,))
        if credentials is None:
            ports[name] = server.add_insecure_port("127.0.0.1:0")
        else:
            ports[name] = server.add_secure_port("127.0.0.1:0", credentials)
        await server.start()
        servers.append(server)
    with tempfile.TemporaryDirectory() as folder:
        Path(folder, "cert.pem").write_bytes(server_cert)
        Path(folder, "key.pem").write_bytes(server_key)
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(Path(folder, "cert.pem"), Path(folder, "key.pem"))
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    for name, tls in (("asyncio_tls", context), ("asyncio_tcp", None)):
        server = await asyncio.start_server(_tcp_echo, "127.0.0.1", 0, ssl=tls, limit=2**22)
        ports[name] = server.sockets[0].getsockname()[1]
    connection.send((ports, server_cert))
    await asyncio.get_running_loop().run_in_executor(None, _answer, connection)
    for server in servers:
        await server.stop(None)


def _answer(connection) -> None:
    """Tells the client this process's CPU seconds so far, whenever it asks, until it says stop."""
    while connection.recv() == "cpu":
        connection.send(time.process_time())


def serve(connection, client_cert: bytes) -> None:
    asyncio.run(_serve(connection, client_cert))


async def _measure(
    ports: dict, server_cert: bytes, client: tuple[bytes, bytes], size: int, repeats: int, server_cpu
) -> dict:
    """Per path, the paths taking turns (one echo each per round): GB/s of the median and the fastest round,
    and the CPU both processes spent per round trip (`server_cpu()`: the server's CPU seconds so far)."""
    data = bytes(size)
    pieces = [memoryview(data)[i : i + PIECE] for i in range(0, size, PIECE)]
    calls, channels, writers = {}, [], []
    for name in ("grpc_mtls", "grpc_insecure"):
        address = f"localhost:{ports[name]}"
        if name == "grpc_mtls":
            credentials = grpc.ssl_channel_credentials(server_cert, client[1], client[0])
            channel = grpc.aio.secure_channel(address, credentials, options=GRPC_OPTIONS)
        else:
            channel = grpc.aio.insecure_channel(address, options=GRPC_OPTIONS)
        channels.append(channel)
        stream = channel.stream_stream(ECHO_METHOD)

        async def grpc_call(stream=stream) -> None:
            got = 0
            async for piece in stream(iter(bytes(p) for p in pieces)):
                got += len(piece)
            assert got == size

        calls[name] = grpc_call
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE  # throughput only: the key is not checked
    for name, tls in (("asyncio_tls", context), ("asyncio_tcp", None)):
        reader, writer = await asyncio.open_connection("127.0.0.1", ports[name], ssl=tls, limit=2**22)
        writers.append(writer)

        async def tcp_call(reader=reader, writer=writer) -> None:
            writer.write(size.to_bytes(8, "big"))
            for piece in pieces:
                writer.write(piece)
            await writer.drain()
            length = int.from_bytes(await reader.readexactly(8), "big")
            await reader.readexactly(length)

        calls[name] = tcp_call
    times: dict[str, list[float]] = {name: [] for name in calls}
    cpu: dict[str, list[float]] = {name: [] for name in calls}
    for call in calls.values():
        await call()  # warm-up
    for _ in range(repeats):
        for name, call in calls.items():
            cpu_before = time.process_time() + server_cpu()
            started = time.perf_counter()
            await call()
            times[name].append(time.perf_counter() - started)
            cpu[name].append(time.process_time() + server_cpu() - cpu_before)
    for channel in channels:
        await channel.close()
    for writer in writers:
        writer.close()
    return {
        name: {
            "gb_per_s": round(2 * size / statistics.median(spent) / 1e9, 3),
            "best_gb_per_s": round(2 * size / min(spent) / 1e9, 3),
            "cpu_ms": round(statistics.median(cpu[name]) * 1e3, 2),
            "cpu_bound_gb_per_s": round(2 * size / statistics.median(cpu[name]) / 1e9, 3),
        }
        for name, spent in times.items()
    }


def measure(size_mib: int = 4, repeats: int = 20) -> dict:
    """GB/s of each TLS alternative (and its plain twin) at `size_mib`, server in a child process."""
    client = certificate(load_identity(None))
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    server = context.Process(target=serve, args=(theirs, client[0]), daemon=True)
    server.start()
    try:
        if not ours.poll(60):
            raise SystemExit("the TLS echo servers did not start within 60 s")
        ports, server_cert = ours.recv()

        def server_cpu() -> float:
            ours.send("cpu")
            return ours.recv()

        return asyncio.run(_measure(ports, server_cert, client, size_mib * 2**20, repeats, server_cpu))
    finally:
        ours.send("stop")
        server.join(10)
        if server.is_alive():
            server.kill()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=20)
    options = parser.parse_args()
    print(json.dumps({"size_mib": options.size_mib, "paths": measure(options.size_mib, options.repeats)}))
