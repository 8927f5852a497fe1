"""How an averaging round cuts the stage's gradient into slices, and how one slice is summed.

Once the members of a round agree on its contributors, the flattened gradient is cut into one
contiguous slice per member that takes part (`slice_owners`: the contributors in sorted order, less
leaving peers that only handed over their gradients). The i-th owner sums slice i of every
contribution, in the contributors' order, and gives the sum to every member. Each element of the sum
sees the same additions in the same order as a sum of whole gradients would, so the round's result is
bit for bit what the all-to-all round gave, while each member sends and receives about two gradient
sizes whatever the number of mates.

An owner's sum is audited by every member that contributed (`audit_excess`): a member sends each owner,
with its part, secret seeds for the other slices; each owner answers, with its sum, the random
projections of its own parts of those slices under those seeds. The member then knows, for the sum of
slice i, the projections of every part but its owner's, which the owner never saw the seeds of. What is
left over is the projection of what the owner put in of its own: more than its bound, and the owner
lied about the sum.

Everything here is pure: the peers and the tests run the same functions.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from swarm.peer.contribution_bounds import clip_scales

CLAIM_TOLERANCE = 1e-3  # a slice's norm over its sender's statement by less is rounding (float32 against float64)
AUDIT_PROJECTIONS = 4  # random projections per audited slice
# the left-over an owner may put in, in units of its own bound: honest, the estimate from 4 Gaussian projections
# exceeds 4 times the true norm with probability 3e-13; a lie 100 times the bound escapes with about 5e-6
AUDIT_FACTOR = 4.0
AUDIT_FLOOR = 1e-3  # float32 rounding of a sum, relative to the bounded norms of its parts


@dataclass
class SliceMessage:
    """A slice as a mate sent it: which round (`digest` of its contributors, `count` slices) and which slice."""

    digest: bytes
    count: int
    index: int
    tensor: torch.Tensor | None = None
    slice_norms: list[float] = field(default_factory=list)  # REDUCED: each contributor's squared slice norm
    audit_seeds: list[int] = field(default_factory=list)  # PART: the sender's seeds for auditing the other sums
    audits: list[float] = field(default_factory=list)  # REDUCED: the owner's projections under the receiver's seeds

    def fits(self, digest: bytes, count: int, index: int) -> bool:
        """Whether the message is slice `index` of the round this peer holds."""
        return (self.digest, self.count, self.index) == (digest, count, index)


@dataclass
class SliceInbox:
    """What mates sent this peer for one attempt of a round, at most one of each kind per sender."""

    parts: dict[str, SliceMessage] = field(default_factory=dict)  # a contribution's slice for this peer to sum
    reduced: dict[str, SliceMessage] = field(default_factory=dict)  # an owner's summed slice
    failed: set[str] = field(default_factory=set)  # owners that could not sum their slice


def slice_owners(contributors: Sequence[str], handovers: set[str]) -> list[str]:
    """The members that own a slice, in order: the contributors (sorted) that take part in the round."""
    return [peer for peer in sorted(contributors) if peer not in handovers]


def slice_bounds(size: int, count: int) -> list[tuple[int, int]]:
    """[start, end) of each of `count` contiguous slices of a vector of `size` elements, as equal as can be."""
    base, extra = divmod(size, count)
    bounds, start = [], 0
    for index in range(count):
        end = start + base + (1 if index < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def slice_length(size: int, count: int, index: int) -> int:
    """Elements in slice `index` of `count` (see `slice_bounds`)."""
    base, extra = divmod(size, count)
    return base + (1 if index < extra else 0)


def contributors_digest(step: int, attempt: int, contributors: Sequence[str]) -> bytes:
    """Names a round's agreed contributors: slices of a round agreed differently are never summed together."""
    text = f"{step}/{attempt}/" + ",".join(sorted(contributors))
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def owner_scales(
    claimed_norms: list[float], slice_norms: list[float], samples: list[int], by_samples: bool = False
) -> list[float]:
    """Per contribution, the factor its slice is multiplied by (see `contribution_bounds`).

    The bound rests on each contribution's whole-gradient norm, which its sender states; an honest
    statement is never smaller than any slice's norm. Where a slice shows more than its sender stated,
    the slice's own norm is taken instead, so understating cannot escape the bound."""
    norms = bounded_norms(claimed_norms, slice_norms)
    return clip_scales([norm / max(count, 1) for norm, count in zip(norms, samples)], samples, by_samples=by_samples)


def bounded_norms(claimed_norms: list[float], slice_norms: list[float]) -> list[float]:
    """Per contribution, the norm its bound rests on: the one its sender stated, or its slice's if that shows more."""
    return [seen if seen > claim * (1 + CLAIM_TOLERANCE) else claim for claim, seen in zip(claimed_norms, slice_norms)]


def audit_projections(piece: torch.Tensor, seed: int) -> list[float]:
    """`AUDIT_PROJECTIONS` projections of a slice (a part or a sum) on standard Gaussian vectors drawn from `seed`."""
    generator = torch.Generator().manual_seed(seed)
    # float32 throughout: fast, and its rounding (about 1e-7 of the norm times the square root of the length)
    # stays far below AUDIT_FLOOR
    vectors = torch.randn(AUDIT_PROJECTIONS, piece.numel(), generator=generator)
    return (vectors @ piece.detach().reshape(-1).cpu().float()).tolist()


def audit_excess(
    total: list[float],
    others: list[list[float]],
    other_scales: list[float],
    owner_bound: float,
    all_bounds: list[float],
) -> tuple[float, float]:
    """(the estimated norm of an owner's own share of a sum, the most it may be): past it, the owner lied.

    `total`: the projections of the sum; `others`: those of every other contribution's part, taken at
    `other_scales`; `owner_bound`: the owner's own bounded norm times its scale; `all_bounds`: every
    contribution's, for the rounding floor. The left-over projections estimate the norm of the owner's own
    share (their mean square is its square, in expectation)."""
    left = [t - sum(scale * p[k] for p, scale in zip(others, other_scales)) for k, t in enumerate(total)]
    estimate = math.sqrt(sum(x * x for x in left) / len(left))
    floor = AUDIT_FLOOR * math.sqrt(sum(b * b for b in all_bounds))
    return estimate, AUDIT_FACTOR * owner_bound + floor


def reduce_slice(pieces: list[torch.Tensor], scales: list[float]) -> torch.Tensor:
    """The sum of the contributions' slices, in the order given, each taken at its scale."""
    total = None
    for piece, scale in zip(pieces, scales):
        part = piece if scale == 1.0 else piece * scale
        total = part.clone() if total is None else total.add_(part)
    assert total is not None
    return total


def squared_norms(pieces: list[torch.Tensor]) -> list[float]:
    """Each slice's squared L2 norm (float64), as an owner reports them with its sum.

    Summed a chunk of `NORM_CHUNK` elements at a time: a float64 copy of a whole slice of a large stage takes
    most of a second to make (measured 0.6 s for 76M elements on one core, 0.03 s in chunks)."""
    return [_squared_norm(piece) for piece in pieces]


def _squared_norm(piece: torch.Tensor) -> float:
    total = 0.0
    for chunk in piece.reshape(-1).split(NORM_CHUNK):
        wide = chunk.double()
        total += float(torch.dot(wide, wide))
    return total


NORM_CHUNK = 1 << 18  # elements: a float64 chunk stays in a core's cache
