"""How long a call took of its peer's own time, seen from the caller. Pure: the trainer and the simulator share it.

The round trip is the wrong measure for routing. Sent a step's microbatches at once, a fast peer takes more
of them and each waits longer behind this caller's own calls queued there: timed by round trips, every peer
looks about as fast as the others. And a peer given one call at a time pays the network both ways on each,
while one given a burst answers them back to back: timed by round trips, the first looks slower and slower
than the second, gets fewer calls, and ends up with almost none (a stage of two equal peers measured one
serving 31 of 577 calls).

So a call took the time from when the peer could start it to its reply: from the later of its arrival (the
round trip less the network time, which the router charges apart: `Router.report_success`) and the peer's
reply to this caller's call before it (the peer serves its queue in order). Timing queued calls by the gap
between replies alone would count the peer's idle wait for the next call, while calls arrive slower than it
serves them, as its service time.
"""

from __future__ import annotations


class ServiceTimer:
    """Per peer, when its latest reply to this caller came; turns each reply into the peer's service seconds."""

    def __init__(self) -> None:
        self._last_reply: dict[str, float] = {}

    def served(self, peer_id: str, sent_at: float, replied_at: float, network_seconds: float = 0.0) -> float:
        """The seconds of `peer_id`'s own time the call sent at `sent_at` and answered at `replied_at` took;
        `network_seconds`: the part of its round trip spent on the network, by the peer's account of its own."""
        previous = self._last_reply.get(peer_id, sent_at)
        self._last_reply[peer_id] = max(replied_at, previous)
        round_trip = max(replied_at - sent_at, 0.0)
        # the peer could start no earlier than the call reached it, nor before it had answered the one before
        # (both seen here one network time later); a peer overstating its network time gains nothing, as the
        # router charges it that time on every call
        busy_from = max(previous, sent_at + min(max(network_seconds, 0.0), round_trip))
        return max(0.0, replied_at - busy_from)
