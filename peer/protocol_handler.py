"""A peer's request-reply protocols as stream handlers: read, answer, reply, wait for the hang-up, close.

As hivemind's servicer turns `rpc_*` methods into handlers, `protocol_handler` turns an answer into
one. It reads the request within the protocol's limits, answers a malformed one with the wire's error
(its code and message), writes the reply, waits for the caller to hang up (a callee that closes first
loses its reply now and then) and closes the stream. An answer is then only its checks and its reply.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from google.protobuf.message import Message

from swarm.net.allowlist import Handler
from swarm.net.uplink_turns import UplinkTurns, frames_bytes
from swarm.net.wire import Part, WireError, WireLimits, read_frames, wait_for_hang_up, write_frames
from swarm.proto import Error, ErrorCode

logger = logging.getLogger(__name__)

# (the caller's peer id, its request, the request's tensor parts, the reply made when the stream opened):
# the frames to send back. An answer refuses by setting the reply's error and returning [reply].
Answer = Callable[[str, Message, list[Part], Message], Awaitable[list]]


def protocol_handler(
    request_type: type[Message],
    new_reply: Callable[[], Message],
    answer: Answer,
    limits: WireLimits = WireLimits(),
    failure: str | None = None,
    caller: str = "a stage-mate",
) -> Handler:
    """A stream handler that reads one `request_type` within `limits` and sends back what `answer` returns.

    `new_reply` makes the reply as the stream opens; a request the wire refuses (too large, malformed,
    cut short) is answered with it, its error set to the wire's. With `failure`, an unexpected exception
    is logged with that line (`{sender}` is the caller's peer id) and answered INTERNAL; without, it
    ends the stream unanswered. `caller` names the other side in the log line of a reply not delivered.
    """

    async def handle(stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sender = str(stream_info.peer_id)
        reply = new_reply()
        try:
            request, parts = await read_frames(reader, request_type, limits)
            frames = await answer(sender, request, parts, reply)
        except WireError as e:
            reply.error.CopyFrom(Error(code=e.code, message=str(e)))
            frames = [reply]
        except Exception as e:
            if failure is None:
                raise
            logger.exception(failure.format(sender=sender))
            reply.error.CopyFrom(Error(code=ErrorCode.INTERNAL, message=f"{type(e).__name__}: {e}"))
            frames = [reply]
        await send_reply(reader, writer, frames, caller)

    return handle


async def send_reply(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    frames: list,
    caller: str,
    level: int = logging.DEBUG,
    uplink: UplinkTurns | None = None,
) -> None:
    """Writes `frames` (in `caller`'s turn of `uplink`, if given), waits for the caller to hang up, and closes; a
    caller gone already is only logged."""
    try:
        if uplink is None:
            await write_frames(writer, frames)
        else:
            await uplink.send(caller, frames_bytes(frames), lambda: write_frames(writer, frames))
        await wait_for_hang_up(reader)
    except Exception as e:
        logger.log(level, f"Could not answer {caller}: {type(e).__name__}: {e}")
    finally:
        with contextlib.suppress(Exception):
            writer.close()
