"""`swarm monitor`: a live web dashboard of the swarm, served over HTTP from a DHT node of its own.

In the background the monitor reads the stage records and the trainers' progress records from the
DHT every `--refresh` seconds and builds a snapshot (`swarm.ops.monitor_snapshot`). The HTTP side only
ever serves the latest snapshot, so a slow or unreachable DHT never holds up a page load. Routes:
`/` (the page, `swarm.ops.dashboard_page`) and `/api/swarm` (the snapshot as JSON); anything else is 404.

The HTTP server is a small one of our own on asyncio streams: one request per connection, GET and
HEAD only, bounded request size and time. It listens on 127.0.0.1 unless told otherwise: the
dashboard needs no login, so expose it to other machines only on a network you trust.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import time
from urllib.parse import urlsplit

from hivemind import DHT
from hivemind.utils import get_dht_time

from swarm.config import MonitorConfig
from swarm.net.dht_node import start_dht
from swarm.ops.dashboard_page import PAGE
from swarm.ops.monitor_snapshot import MonitorHistory, build_snapshot
from swarm.process.event_loop import run, stop_event_on_signals
from swarm.records.stage_records import fetch_stage_records
from swarm.records.trainer_records import fetch_trainer_records

logger = logging.getLogger(__name__)

REQUEST_TIMEOUT = 10.0  # seconds a client has to send its request
MAX_HEADER_BYTES = 16384
READ_TIMEOUT = 30.0  # a DHT read taking longer than this is reported on the page (and still awaited)
REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    431: "Request Header Fields Too Large",
}


class MonitorError(RuntimeError):
    """The monitor cannot serve: the message says why (e.g. the port is taken)."""


class Monitor:
    """Reads the swarm from the DHT on a period and serves the dashboard and its JSON."""

    def __init__(self, dht: DHT, config: MonitorConfig) -> None:
        self.dht = dht
        self.config = config
        self.history = MonitorHistory()
        self.error: str | None = None
        self._read_at: float | None = None  # monotonic time of the last successful read
        self._snapshot = self._encode(build_snapshot(config.run_id, config.num_stages, {}, [], self.history, 0.0))

    @staticmethod
    def _encode(snapshot: dict) -> bytes:
        return json.dumps(snapshot, separators=(",", ":"), allow_nan=False).encode()

    def read_swarm(self) -> bytes:
        """One DHT read, folded into the history and encoded; blocking, so it runs off the loop."""
        config = self.config
        records = fetch_stage_records(self.dht, config.run_id, config.num_stages)
        trainers = fetch_trainer_records(self.dht, config.run_id)
        return self._encode(
            build_snapshot(config.run_id, config.num_stages, records, trainers, self.history, get_dht_time())
        )

    async def refresh_forever(self) -> None:
        """Reads the swarm every --refresh seconds until cancelled; a failed read is shown, then retried."""
        loop = asyncio.get_running_loop()
        while True:
            reading = loop.run_in_executor(None, self.read_swarm)
            try:
                try:
                    self._snapshot = await asyncio.wait_for(asyncio.shield(reading), READ_TIMEOUT)
                except asyncio.TimeoutError:
                    self.error = f"reading the DHT takes over {READ_TIMEOUT:.0f}s"
                    self._snapshot = await reading  # one read at a time: a stuck DHT must not pile them up
                self._read_at = time.monotonic()
                self.error = None
            except Exception as e:
                self.error = f"{type(e).__name__}: {e}"[:300]
                logger.warning(f"Could not read the swarm from the DHT ({self.error}); retrying")
            await asyncio.sleep(self.config.refresh)

    def api_body(self) -> bytes:
        """The latest snapshot, with how old it is and the last read's error, if any."""
        age = None if self._read_at is None else round(time.monotonic() - self._read_at, 2)
        extra = json.dumps({"age": age, "error": self.error}, separators=(",", ":")).encode()
        # spliced rather than re-encoded: the snapshot (with its history) is encoded once per read
        return extra[:-1] + b"," + self._snapshot[1:]

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Answers one HTTP request on a connection, then closes it."""
        try:
            status, content_type, body, method = await asyncio.wait_for(self._answer(reader), REQUEST_TIMEOUT)
            head = (
                f"HTTP/1.1 {status} {REASONS[status]}\r\n"
                f"Content-Type: {content_type}\r\n"
                f"Content-Length: {len(body)}\r\n"
                "Cache-Control: no-store\r\n"
                "X-Content-Type-Options: nosniff\r\n"
                "Connection: close\r\n\r\n"
            )
            writer.write(head.encode() + (b"" if method == "HEAD" else body))
            await asyncio.wait_for(writer.drain(), REQUEST_TIMEOUT)
        except (asyncio.TimeoutError, ConnectionError, asyncio.IncompleteReadError):
            pass  # a client that is too slow or went away gets nothing more
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _answer(self, reader: asyncio.StreamReader) -> tuple[int, str, bytes, str]:
        """(status, content type, body, method) for the request on `reader`."""
        text = "text/plain; charset=utf-8"
        try:
            request_line = await reader.readline()
            size = len(request_line)
            while True:
                line = await reader.readline()
                size += len(line)
                if size > MAX_HEADER_BYTES:
                    return 431, text, b"request headers too large\n", "GET"
                if line in (b"\r\n", b"\n", b""):
                    break
        except (ValueError, asyncio.LimitOverrunError):  # a line past the reader's limit
            return 431, text, b"request line too long\n", "GET"
        parts = request_line.decode("latin-1").split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return 400, text, b"bad request\n", "GET"
        method, target = parts[0], parts[1]
        if method not in ("GET", "HEAD"):
            return 405, text, b"only GET and HEAD\n", "GET"
        path = urlsplit(target).path
        if path in ("/", "/index.html"):
            return 200, "text/html; charset=utf-8", PAGE.encode(), method
        if path == "/api/swarm":
            return 200, "application/json", self.api_body(), method
        return 404, text, b"not found\n", method

    async def serve(self) -> None:
        """Serves until SIGTERM or Ctrl-C."""
        stop = stop_event_on_signals()
        try:
            server = await asyncio.start_server(self.handle, self.config.host, self.config.port)
        except OSError as e:
            where = f"{self.config.host}:{self.config.port}"
            if e.errno == errno.EADDRINUSE:
                raise MonitorError(f"{where} is in use; choose another --port (0: any free one)") from None
            raise MonitorError(f"cannot listen on {where}: {e.strerror or e}; check --host and --port") from None
        port = server.sockets[0].getsockname()[1]
        host = self.config.host if ":" not in self.config.host else f"[{self.config.host}]"
        print(f"Dashboard: http://{host}:{port}/", flush=True)
        refreshing = asyncio.create_task(self.refresh_forever())
        try:
            await stop.wait()
            logger.info("Stopping the monitor")
        finally:
            refreshing.cancel()
            server.close()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(server.wait_closed(), 5)


def run_monitor(config: MonitorConfig) -> None:
    """`swarm monitor`: joins the DHT, then serves the dashboard until SIGTERM or Ctrl-C."""
    dht = start_dht(config)  # forks: before the event loop and its threads
    try:
        run(Monitor(dht, config).serve())
    finally:
        dht.shutdown()
