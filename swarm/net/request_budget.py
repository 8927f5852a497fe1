"""The bytes of stage requests a peer holds at once, over every caller: past its budget it answers busy.

Each caller is bounded on its own (streams per caller, bytes per request), but many identities are
cheap: without a bound over all of them, a crowd of callers each sending its largest request would
hold that many requests' bytes in memory at once. A request takes its frames' bytes from the budget as
they arrive, before reading them, and gives them back once it is answered; one that does not fit is
refused with UNAVAILABLE, so its caller tries another peer of the stage.
"""

from __future__ import annotations

from swarm.net.wire import WireError
from swarm.proto import ErrorCode


class RequestBudget:
    """Bytes of requests held, against a limit (at least two of the largest requests, so one always fits)."""

    def __init__(self, limit_bytes: int, largest_request: int) -> None:
        self.limit = max(limit_bytes, 2 * largest_request)
        self.held = 0
        self.refused = 0  # requests refused for the budget

    def ticket(self) -> BudgetTicket:
        """The account of one request: what it took, given back when it is done."""
        return BudgetTicket(self)


class BudgetTicket:
    """One request's share of the budget; `take` is called with each frame's size before its bytes are read."""

    def __init__(self, budget: RequestBudget) -> None:
        self.budget = budget
        self.taken = 0

    def take(self, size: int) -> None:
        """Takes `size` bytes for this request, or raises WireError(UNAVAILABLE) where the budget has none."""
        budget = self.budget
        if budget.held + size > budget.limit:
            budget.refused += 1
            raise WireError(
                ErrorCode.UNAVAILABLE,
                f"this peer is busy: it holds {budget.held / 2**20:.1f} MiB of requests, its --request-memory-mb "
                f"is {budget.limit / 2**20:.0f}; try another peer of the stage",
            )
        budget.held += size
        self.taken += size

    def __enter__(self) -> BudgetTicket:
        return self

    def __exit__(self, *_) -> None:
        self.budget.held -= self.taken
        self.taken = 0
