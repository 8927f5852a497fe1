"""DHT walks that ask a node for every key it has not yet been asked for in one call.

hivemind's `get_many` walks the DHT for several keys at once but packs only the square root of their
number into one call to a node: one key per call for up to three keys. A peer reads its own stage
and the stages it holds standby copies of every announce period, with every replica asked (the
records are merged from all of them), so a read of two stages cost every node it asked two calls,
and its DHT process and libp2p daemon did twice the work of a read of one (`scripts/bench_standby.py`
counted those processes' CPU). A call's cost is mostly its own (a stream through the daemon, its
framing and signing), not its keys', so a walk now puts up to `MAX_KEYS_PER_CALL` keys into each call.
"""

from __future__ import annotations

import functools
from typing import Any

import hivemind.dht.node as hivemind_node

MAX_KEYS_PER_CALL = 16  # as many as hivemind's default chunk size; a read of every stage of a deep model


def packing_walk(walk: Any) -> Any:
    """`walk` (hivemind's `traverse_dht`) with at least `min(len(queries), MAX_KEYS_PER_CALL)` queries a call."""

    if getattr(walk, "packs_queries", False):
        return walk

    @functools.wraps(walk)
    def packed(queries: list, *args: Any, queries_per_call: int, **kwargs: Any) -> Any:
        wanted = min(len(queries), MAX_KEYS_PER_CALL)
        return walk(queries, *args, queries_per_call=max(queries_per_call, wanted), **kwargs)

    packed.packs_queries = True
    return packed


def pack_walk_queries() -> None:
    """Makes this process's DHT node pack every key of a walk into its calls (call in the DHT's process, before its
    node starts); calling it again changes nothing."""
    hivemind_node.traverse_dht = packing_walk(hivemind_node.traverse_dht)
