"""The swarm's settings as its serving peers announce them, and a newcomer's check of its own against them.

A stage record carries the settings of its peer that the whole swarm must share (`ANNOUNCED`): the
model, its cut into stages, the token ids it knows, the samples a stage steps on, the dtype it computes
in (`--dtype`, as it resolves on the peer's device: a trainer's auto takes the swarm's). A value in a
record is a claim (the signature proves who makes it, not that it is right), so a newcomer takes a
value for the swarm's only where more than half of the serving peers announce it, and then (where two
of them at least do: one identity alone cannot stop a newcomer) refuses to start with a setting that
differs, naming the setting and the value to use. Where the serving peers are split, or none serves
yet, there is nothing to check against. The other settings of the
swarm file (`swarm.config.swarm_file`: seed, optimizer, codecs) are in no record, so not checked.

Once running, a process never stops for a record that disagrees: `disagreements` names each record whose
setting differs from what this process uses (its own setting where it has one, else the value more than
half of the distinct peers announce; on a tie there is none, so no single identity decides), and the
record is ignored, not obeyed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from hivemind import DHT

from swarm.config import ConfigError, ModelConfig
from swarm.models.precision import resolve_dtype
from swarm.records.stage_records import SERVING, StageRecord, fetch_stage_records

ANNOUNCED = ("model", "num_stages", "stage_blocks", "vocab_size", "target_batch_size", "dtype")
# the value of a record from before a setting was announced, which says nothing about it
UNANNOUNCED = {"vocab_size": 0, "dtype": ""}
REFUSING_PEERS = 2  # serving peers that must agree on a value before a newcomer that differs is refused


def swarm_settings(records: Iterable[StageRecord], exclude: str = "", least: int = 1) -> tuple[dict[str, Any], int]:
    """The value of each setting in `ANNOUNCED` that more than half of the serving peers, and `least` of them at
    least, announce (none where they are split), and how many peers serve; the record of peer `exclude` (the
    newcomer's own, from before a restart) is not counted."""
    serving = {r.peer_id: r for r in records if r.state == SERVING and r.peer_id != exclude}.values()
    settings: dict[str, Any] = {}
    for name in ANNOUNCED:
        values = Counter(getattr(r, name) for r in serving if getattr(r, name) != UNANNOUNCED.get(name))
        if values:
            value, count = values.most_common(1)[0]
            if 2 * count > sum(values.values()) and count >= least:
                settings[name] = value
    return settings, len(serving)


def differing_settings(config: ModelConfig, records: Iterable[StageRecord], exclude: str = "") -> str | None:
    """The error a newcomer with `config` stops with, naming each setting where most of the swarm's serving peers
    (`REFUSING_PEERS` of them at least: one identity alone stops no process) announce another value and the value
    to use; None if nothing differs."""
    swarm, serving = swarm_settings(records, exclude, least=REFUSING_PEERS)
    mine = {
        "model": (config.model, config.model),
        "num_stages": (config.num_stages, config.num_stages),
        "vocab_size": (config.model_spec().vocab_size, config.vocab_size),  # compared as the model knows it
    }
    if hasattr(config, "target_batch_size"):  # a trainer takes the peers' own
        mine["target_batch_size"] = (config.target_batch_size, config.target_batch_size)
    if hasattr(config, "device") or config.stage_blocks:  # a peer builds its stage by the cut; a trainer may take it
        mine["stage_blocks"] = (tuple(config.stage_blocks), tuple(config.stage_blocks))
    if hasattr(config, "device"):  # a peer: what its --dtype means on its device
        mine["dtype"] = (resolve_dtype(config.dtype, config.device), config.dtype)
    elif config.dtype != "auto":  # a trainer's auto takes the swarm's
        mine["dtype"] = (config.dtype, config.dtype)
    differ = [
        (name, swarm[name], given) for name, (value, given) in mine.items() if name in swarm and swarm[name] != value
    ]
    if not differ:
        return None
    flags = ", ".join(
        f"--{name.replace('_', '-')} {_shown(value)} (you gave {_shown(given)})" for name, value, given in differ
    )
    keys = ", ".join(f"{name}: {_shown(value)}" for name, value, _ in differ)
    return (
        f"this swarm trains with {flags}, as most of its {serving} serving peers announce: "
        f"set {keys} or use the swarm's file"
    )


def _shown(value: Any) -> str:
    """A setting's value as its flag takes it: a cut as 1,2,3, and the even cut as ''."""
    if isinstance(value, tuple):
        return ",".join(map(str, value)) or "''"
    return str(value)


def check_against_swarm(config: ModelConfig, dht: DHT, run_id: str) -> dict[str, Any]:
    """Reads the swarm's records through `dht` (joined already) and raises ConfigError if `config` differs from
    the settings most of its serving peers announce (see `differing_settings`); returns those settings."""
    records = [r for stage in fetch_stage_records(dht, run_id, config.num_stages).values() for r in stage]
    problem = differing_settings(config, records, exclude=str(dht.peer_id))
    if problem is not None:
        raise ConfigError(problem)
    return swarm_settings(records, exclude=str(dht.peer_id))[0]


@dataclass(frozen=True)
class Disagreement:
    """A record whose `setting` differs from the one this process uses: which peer, what it said, and why the
    other value is the one used (`basis`)."""

    peer_id: str
    stage: int
    setting: str
    announced: Any
    used: Any
    basis: str

    def describe(self) -> str:
        """The warning that names it."""
        return (
            f"Ignoring peer {self.peer_id} of stage {self.stage}: it announces {self.setting} {self.announced}, "
            f"this process uses {self.used} ({self.basis})"
        )


def used_settings(records: Iterable[StageRecord], own: Mapping[str, Any]) -> dict[str, tuple[Any, str]]:
    """For each setting in `ANNOUNCED`: the value this process uses and why: its own where `own` has it, else the
    value more than half of the distinct serving peers of `records` announce (none on a tie, or with no
    announcement). A joining record counts for nothing: any identity may publish one, and a peer that serves
    has shown its settings work."""
    values: dict[str, dict[str, Any]] = {name: {} for name in ANNOUNCED}
    for r in records:
        if r.state != SERVING:
            continue
        for name in ANNOUNCED:
            value = getattr(r, name)
            if value != UNANNOUNCED.get(name):
                values[name].setdefault(r.peer_id, value)
    used: dict[str, tuple[Any, str]] = {}
    for name in ANNOUNCED:
        if name in own:
            used[name] = (own[name], "this process's own setting")
            continue
        counts = Counter(values[name].values())
        if counts:
            value, count = counts.most_common(1)[0]
            total = sum(counts.values())
            if 2 * count > total:
                used[name] = (value, f"as {count} of {total} serving peers announce")
    return used


def disagreements(records: Iterable[StageRecord], own: Mapping[str, Any]) -> list[Disagreement]:
    """The records whose announced settings differ from those this process uses (`used_settings`), one entry per
    record and setting; a record that announces nothing of a setting (from before it existed) differs in none."""
    records = list(records)
    used = used_settings(records, own)
    found = []
    for r in records:
        for name, (value, basis) in used.items():
            announced = getattr(r, name)
            if announced != value and announced != UNANNOUNCED.get(name):
                found.append(Disagreement(r.peer_id, r.stage, name, announced, value, basis))
    return found
