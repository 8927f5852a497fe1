"""When a peer sends its round offer back to a member whose own offer reached it outside its gather.

A member that waits for this peer's offer says so by offering again: its probes send its offer to the members
it waits for (`round_waiting`). And a member that refused this peer's offer from behind (it was still loading a
state) offers only once it has loaded, often after this peer's gather has ended without it; its gather then
waits for an offer this peer never sends again. A wave run: two newcomers took their state from a stage's one
peer within 0.2 s; one refused the other's offer, 21 ms before it loaded; the other had gathered, so the one
waited for its offer, and the stage's round, which counted it in, waited for its commit: 17 s, until the
averaging timeout. So this peer sends its offer back, once per member and attempt, to a member whose offer
comes again or comes after this peer's gather of that attempt ended.
"""

from __future__ import annotations

KEPT_ATTEMPTS = 8  # (step, attempt) pairs remembered: a few steps' rounds


class OfferAnswers:
    """Which members' offers this peer answers with its own."""

    def __init__(self) -> None:
        self.gathered: set[tuple[int, int]] = set()  # attempts whose gather ended here
        self.answered: dict[tuple[int, int], set[str]] = {}  # per attempt: members sent this peer's offer back

    def gather_ended(self, step: int, attempt: int) -> None:
        self.gathered.add((step, attempt))
        self._trim()

    def should_answer(self, sender: str, step: int, attempt: int, repeat: bool) -> bool:
        """Whether to send this peer's offer of `attempt` back to `sender`, whose offer of it just came (`repeat`:
        this peer held one of its before); counts it as answered if so."""
        key = (step, attempt)
        if not (repeat or key in self.gathered) or sender in self.answered.get(key, ()):
            return False
        self.answered.setdefault(key, set()).add(sender)
        self._trim()
        return True

    def _trim(self) -> None:
        while len(self.gathered) > KEPT_ATTEMPTS:
            self.gathered.discard(min(self.gathered))
        while len(self.answered) > KEPT_ATTEMPTS:
            del self.answered[min(self.answered)]
