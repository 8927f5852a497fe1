"""The router, without a network: speed-weighted choice, bans, record merging."""

from __future__ import annotations

import dataclasses
import heapq
import random
from collections import Counter

from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure

from swarm.net.transport import StageCallError, dial_refused
from swarm.policy.router import Router
from swarm.policy.service_timing import ServiceTimer
from swarm.proto import ErrorCode
from swarm.records.stage_records import LEAVING, SERVING, StageRecord


def record(peer: str, throughput: float = 10.0, state: str = SERVING, expiration: float = 100.0) -> StageRecord:
    return StageRecord(peer, 0, "gpt-tiny", 3, state, 0, throughput, 0, 32, 0, 2, expiration)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def share_of_work(router: Router, calls: int, seconds_per_sample: dict[str, float]) -> dict[str, float]:
    """Routes `calls` backward calls of 8 samples, reporting each as taking the peer's true time."""
    counts = Counter()
    for _ in range(calls):
        peer = router.choose(0, backward=True, samples=8).peer_id
        router.report_success(peer, backward=True, samples=8, seconds=8 * seconds_per_sample[peer])
        counts[peer] += 1
    return {peer: counts[peer] / calls for peer in seconds_per_sample}


def test_work_is_shared_in_proportion_to_observed_speed():
    # announced speeds are wrong on purpose: observed service times must take over
    router = Router(rng=random.Random(0))
    router.update({0: [record("fast", 1.0), record("mid", 1.0), record("slow", 50.0)]}, now=0.0)
    speeds = {"fast": 60.0, "mid": 30.0, "slow": 10.0}  # samples per second
    shares = share_of_work(router, 5_000, {peer: 1 / speed for peer, speed in speeds.items()})
    for peer, speed in speeds.items():
        assert abs(shares[peer] - speed / 100) < 0.02, shares


def test_calls_interleave_rather_than_burst():
    router = Router(rng=random.Random(0))
    router.update({0: [record("a"), record("b")]}, now=0.0)
    picks = "".join(router.choose(0, backward=True).peer_id for _ in range(1_000))
    assert "aaa" not in picks and "bbb" not in picks  # equal peers take turns (ties broken at random)


def test_announced_speed_routes_a_trainer_that_has_no_observations():
    router = Router(rng=random.Random(0))
    router.update({0: [record("fast", 30.0), record("slow", 10.0)]}, now=0.0)
    counts = Counter(router.choose(0, backward=False, samples=8).peer_id for _ in range(4_000))
    assert abs(counts["fast"] / 4_000 - 0.75) < 0.02


def test_forward_and_backward_costs_are_tracked_apart():
    router = Router(rng=random.Random(0))
    router.update({0: [record("a")]}, now=0.0)
    router.report_success("a", backward=False, samples=4, seconds=0.4)
    router.report_success("a", backward=True, samples=4, seconds=1.2)
    (a,) = router.live_peers(0)
    assert router.expected_seconds(a, False, 2) == 0.2 and router.expected_seconds(a, True, 2) == 0.6


def test_newcomer_is_tried_at_once():
    router = Router(rng=random.Random(0))
    router.update({0: [record("old")]}, now=0.0)
    for _ in range(100):
        router.choose(0, backward=True)
    router.update({0: [record("old"), record("new")]}, now=1.0)
    assert router.choose(0, backward=True).peer_id == "new"


def test_deadline_follows_latency_within_floor_and_ceiling():
    router = Router(deadline_floor=2.0, deadline_ceiling=30.0, deadline_factor=4.0)
    router.update({0: [record("a"), record("b"), record("c")]}, now=0.0)
    router.report_success("a", True, 8, 8 * 0.01)  # 80 ms a call: 4x is under the floor
    router.report_success("b", True, 8, 8 * 0.2)  # 1.6 s: 4x is 6.4 s
    router.report_success("c", True, 8, 8 * 2.0)  # 16 s: 4x is over the ceiling
    peers = {r.peer_id: r for r in router.live_peers(0)}
    assert router.deadline(peers["a"], True, 8) == 2.0
    assert abs(router.deadline(peers["b"], True, 8) - 6.4) < 1e-9
    assert router.deadline(peers["c"], True, 8) == 30.0


def test_failing_peer_is_banned_with_backoff_until_the_ban_ends():
    clock = Clock()
    router = Router(rng=random.Random(0), clock=clock)
    router.update({0: [record("a"), record("b")]}, now=0.0)
    assert router.report_failure("a") == 1.0
    assert {router.choose(0).peer_id for _ in range(200)} == {"b"}  # no work at all while banned
    clock.now = 1.5
    assert "a" in {router.choose(0).peer_id for _ in range(200)}
    assert router.report_failure("a") == 2.0  # consecutive failures double the ban
    router.report_success("a")
    assert router.report_failure("a") == 1.0


def test_calls_in_flight_when_a_ban_began_do_not_lengthen_it_and_a_ban_stays_on_its_stage():
    """A p3 replay: four calls into a peer leaving stage 0 failed at once and banned it for 1, 2, 4 and 8 s; it
    had left to restore stage 1, and the trainer waited 6 s for stage 1, whose only peer it was, banned."""
    clock = Clock()
    router = Router(rng=random.Random(0), clock=clock)
    mover = dataclasses.replace(record("mover"), stage=1)
    router.update({0: [record("mover"), record("b")], 1: [mover]}, now=0.0)
    assert [router.report_failure("mover", stage=0) for _ in range(4)] == [1.0, 1.0, 1.0, 1.0]
    assert "mover" not in {r.peer_id for r in router.live_peers(0)}
    assert [r.peer_id for r in router.live_peers(1)] == ["mover"], "banned where it failed, not where it went"
    clock.now = 1.5  # the ban lapsed: a failure now is a new one, and doubles it
    assert router.report_failure("mover", stage=0) == 2.0
    assert router.report_failure("mover", stage=1) == 1.0, "another stage's failures start their own count"
    assert router.report_failure("b") == 1.0 and "b" not in {r.peer_id for r in router.live_peers(0)}


def test_a_peer_whose_address_refused_the_dial_gets_no_call_until_a_newer_record_of_it_is_read():
    clock = Clock()
    router = Router(rng=random.Random(0), clock=clock, probation=True)
    router.update({0: [record("dead", expiration=10.0), record("restorer", expiration=10.0)]}, now=0.0)
    router.report_success("dead", samples=8, seconds=0.1)
    router.report_failure("dead", refused=True)
    clock.now = 100.0  # long past any ban: a ban alone made the dead peer look live again, and it took the calls
    assert [r.peer_id for r in router.live_peers(0)] == ["restorer"]
    assert {router.choose(0).peer_id for _ in range(50)} == {"restorer"}
    router.update({0: [record("dead", expiration=10.0)]}, now=1.0)  # the same record read again: still gone
    assert "dead" not in {r.peer_id for r in router.live_peers(0)}
    router.update({0: [record("dead", expiration=12.0)]}, now=2.0)  # renewed: it lives (a relay came back, say)
    assert "dead" in {r.peer_id for r in router.live_peers(0)}
    router.report_failure("restorer")  # any other failure is a ban that lapses, as before
    assert router.gone == {}
    # a refused dial of a peer with no known record marks nothing: there is no record to wait past
    router.report_failure("unknown", refused=True)
    assert "unknown" not in router.gone


def test_a_peer_whose_broken_call_is_found_dead_later_is_gone_before_its_ban_ends():
    """A peer killed mid-call resets its streams: no refused dial, a ban that lapses in a second, and in the p3
    replays the next call went into the dead peer. The trainer checks its direct address in the background and,
    once it refuses, marks it gone: no call until a newer record."""
    clock = Clock()
    router = Router(rng=random.Random(0), clock=clock)
    router.update({0: [record("killed", expiration=10.0), record("mate", expiration=10.0)]}, now=0.0)
    assert router.report_failure("killed") == 1.0
    router.mark_gone("killed")
    clock.now = 5.0  # the ban has lapsed
    assert {router.choose(0).peer_id for _ in range(50)} == {"mate"}
    router.update({0: [record("killed", expiration=12.0), record("mate", expiration=12.0)]}, now=3.0)
    assert "killed" in {r.peer_id for r in router.live_peers(0)}, "a newer record: back"


def test_a_refused_dial_is_told_apart_from_a_slow_or_broken_answer():
    refused = "ControlFailure: Connect failed. msg=failed to dial: failed to dial Qm: dial backoff"
    assert dial_refused(StageCallError(ErrorCode.UNAVAILABLE, refused, "Qm"))
    assert dial_refused(ControlFailure("Connect failed. msg=failed to dial: connect: connection refused"))
    for detail in ("no reply within 15.0s", "bad reply: stream ended in the middle of a message"):
        assert not dial_refused(StageCallError(ErrorCode.UNAVAILABLE, detail, "Qm"))
    assert not dial_refused(StageCallError(ErrorCode.FORBIDDEN, refused, "Qm"))  # the peer's own answer


def test_records_survive_a_missed_read_until_they_expire_and_leaving_peers_get_no_work():
    router = Router()
    router.update({0: [record("a", expiration=10.0), record("b", expiration=10.0)]}, now=0.0)
    router.update({0: []}, now=5.0)  # a DHT read that found nothing
    assert {r.peer_id for r in router.live_peers(0)} == {"a", "b"}
    router.update({0: [record("b", state=LEAVING, expiration=12.0)]}, now=6.0)
    assert {r.peer_id for r in router.live_peers(0)} == {"a"}
    router.update({0: []}, now=11.0)
    assert router.live_peers(0) == [] and router.choose(0) is None


def test_newcomers_are_routed_while_finish_times_are_negative():
    # a newcomer starts below the current minimum: finish times go negative, ties must still resolve
    for seed in range(20):
        router = Router(rng=random.Random(seed), clock=Clock())
        router.update({0: [record("a", 10.0), record("b", 1.0)]}, now=0.0)
        assert router.choose(0) is not None
        router.update({0: [record("c", 5.0)]}, now=0.0)
        chosen = [router.choose(0).peer_id for _ in range(20)]
        assert "c" in chosen


def test_a_peer_announcing_a_smaller_microbatch_than_a_call_is_passed_over_while_others_take_it():
    router = Router(rng=random.Random(0))
    small = dataclasses.replace(record("small", 100.0), max_microbatch=4)
    router.update({0: [small, record("big", 10.0)]}, now=0.0)
    assert {router.choose(0, samples=8).peer_id for _ in range(20)} == {"big"}
    assert "small" in {router.choose(0, samples=4).peer_id for _ in range(20)}
    router.update({0: [dataclasses.replace(record("big", 10.0, state=LEAVING), expiration=101.0)]}, now=1.0)
    assert router.choose(0, samples=8).peer_id == "small"  # the only one left: tried, it answers what it can


def test_a_slow_peer_gets_no_call_of_a_burst_that_faster_peers_finish_sooner():
    # a step's microbatches come as a burst after the stage idled: the step waits for its last call, so a call
    # goes to a slow peer only if it would end there before the fast peers are through with the others
    clock = Clock()
    router = Router(rng=random.Random(0), clock=clock)
    router.update({0: [record("fast"), record("slow")]}, now=0.0)
    router.report_success("fast", backward=True, samples=1, seconds=0.1)
    router.report_success("slow", backward=True, samples=1, seconds=1.0)
    for burst in range(20):
        clock.now = 100.0 * (burst + 1)  # idle in between
        chosen = [router.choose(0, backward=True, samples=1).peer_id for _ in range(6)]
        assert chosen == ["fast"] * 6, (burst, chosen)
    # a seventh and later calls would end on the fast peer after 0.7 s, 0.8 s...: the slow one takes its share
    chosen = Counter(router.choose(0, backward=True, samples=1).peer_id for _ in range(11))
    assert chosen == {"fast": 10, "slow": 1}


def test_a_call_queued_behind_others_gets_a_deadline_that_counts_them():
    clock = Clock()
    router = Router(rng=random.Random(0), clock=clock, deadline_floor=1.0, deadline_ceiling=60.0, deadline_factor=4.0)
    router.update({0: [record("a")]}, now=0.0)
    router.report_success("a", backward=True, samples=1, seconds=1.0)
    for _ in range(10):
        chosen = router.choose(0, backward=True, samples=1)
    assert router.deadline(chosen, True, 1) == 40.0  # it ends after the nine before it: 10 s expected
    clock.now = 9.5
    assert router.deadline(chosen, True, 1) == 4.0  # its own second, once those are done


def test_a_peer_is_timed_by_its_replies_not_by_the_wait_behind_this_trainers_own_calls():
    timer = ServiceTimer()
    # three calls sent at once to a peer that serves one a second, in order: each took a second of its time
    assert [timer.served("p", 0.0, replied) for replied in (1.0, 2.0, 3.0)] == [1.0, 1.0, 1.0]
    # one sent after an idle spell: its round trip less its time on the network
    assert timer.served("p", 8.5, 10.0, network_seconds=0.25) == 1.25
    assert timer.served("q", 8.0, 10.0) == 2.0  # peers are timed apart
    assert timer.served("q", 11.0, 12.0, network_seconds=5.0) == 0.0  # a network time beyond the round trip


def test_two_equal_peers_behind_a_slow_link_share_calls_that_arrive_slower_than_they_serve():
    """Calls reach a stage as the stage before answers them, here slower than one peer serves them. Each peer's
    service time must come out as its compute, whether it was sent calls alone (which pay the network both
    ways) or in bursts (whose gaps between replies include its wait for the next call); and equal peers,
    their timings differing by noise, must share the calls rather than one taking nearly all."""
    for seed in range(4):
        clock, timer, rng = Clock(), ServiceTimer(), random.Random(seed)
        router = Router(rng=random.Random(seed), clock=clock)
        router.update({0: [record("a"), record("b")]}, now=0.0)
        compute, network, period = 0.02, 0.2, 0.05
        free_at = {"a": 0.0, "b": 0.0}  # when each peer is done with what it was sent
        events = [(k * period + rng.uniform(0, period), None, 0.0) for k in range(600)]  # (time, peer, sent at)
        heapq.heapify(events)
        counts = Counter()
        while events:
            clock.now, peer, sent = heapq.heappop(events)
            if peer is None:  # a call to send
                peer = router.choose(0, backward=True, samples=1).peer_id
                free_at[peer] = max(free_at[peer], clock.now + network / 2) + compute * rng.uniform(0.8, 1.2)
                heapq.heappush(events, (free_at[peer] + network / 2, peer, clock.now))
                counts[peer] += 1
            else:
                router.report_success(peer, True, 1, timer.served(peer, sent, clock.now, network), network)
        assert min(counts.values()) / sum(counts.values()) > 0.4, (seed, counts)
        assert all(abs(router.service[(p, True)] - compute) < 0.006 for p in "ab"), router.service


def test_on_probation_a_peer_that_never_answered_gets_trials_not_work():
    router = Router(rng=random.Random(0), probation=True)
    router.update({0: [record("honest"), record("silent-1"), record("silent-2"), record("silent-3")]}, now=0.0)
    # before any peer answered, every peer takes work: a fresh stage has no one else to give it to
    assert {router.choose(0).peer_id for _ in range(40)} == {"honest", "silent-1", "silent-2", "silent-3"}
    router.report_success("honest", samples=8, seconds=0.1)
    assert {router.choose(0).peer_id for _ in range(40)} == {"honest"}
    # trials go to the silent ones, two at a time per stage, each peer once until its trial ends
    first, second = router.trial_candidate(0), router.trial_candidate(0)
    assert {first.peer_id, second.peer_id} < {"silent-1", "silent-2", "silent-3"} and first != second
    assert router.trial_candidate(0) is None
    router.trial_done(first.peer_id)
    router.report_failure(first.peer_id)  # a failed trial bans it: the next trial goes to another
    third = router.trial_candidate(0)
    assert third.peer_id not in (first.peer_id, second.peer_id)
    router.trial_done(second.peer_id)
    router.report_success(second.peer_id, samples=8, seconds=0.1)  # an answered trial ends its probation
    assert {router.choose(0).peer_id for _ in range(400)} == {"honest", second.peer_id}


def test_on_probation_peers_take_work_when_no_peer_that_answered_is_live():
    router = Router(rng=random.Random(0), clock=lambda: 0.0, probation=True)
    router.update({0: [record("answered"), record("newcomer")]}, now=0.0)
    router.report_success("answered", samples=8, seconds=0.1)
    router.report_failure("answered")  # banned: the newcomer is all the stage has
    assert router.choose(0).peer_id == "newcomer"
    assert router.trial_candidate(0) is None  # no trial needed: it takes work as it is


def test_every_peer_gets_its_first_call_of_each_kind_before_any_gets_a_second():
    # speeds measured at start beside others loading: a peer that started slow is still tried, and timed
    claims = {"a": 369.0, "b": 223.0, "c": 200.0, "e": 43.0, "f": 20.0}
    for backward in (False, True):
        router = Router(rng=random.Random(0))
        router.update({0: [record(peer, throughput) for peer, throughput in claims.items()]}, now=0.0)
        assert {router.choose(0, backward=backward, samples=4).peer_id for _ in range(5)} == set(claims)
    # then the claims route, until the calls' timings take over
    later = Counter(router.choose(0, backward=True, samples=4).peer_id for _ in range(200))
    assert later["a"] > later["c"] > later["f"], later
