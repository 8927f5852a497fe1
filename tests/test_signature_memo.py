"""Signed DHT records checked once each: the same verdicts as hivemind's validator, a record seen again unverified."""

from __future__ import annotations

import dataclasses

from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.validation import DHTRecord
from hivemind.utils import MSGPackSerializer, get_dht_time

from swarm.net.identity import load_identity
from swarm.net.signature_memo import SignatureMemoValidator, record_digest


def signed_record(owner, value: object, expiration: float) -> DHTRecord:
    record = DHTRecord(b"stage_key", owner.local_public_key, MSGPackSerializer.dumps(value), expiration)
    return dataclasses.replace(record, value=owner.sign_value(record))


def test_verdicts_match_hivemind_and_a_record_seen_again_is_not_verified_again():
    owner, reader = load_identity(None).validator, load_identity(None).validator
    plain = RSASignatureValidator(load_identity(None).key)
    expiration = get_dht_time() + 10
    good = signed_record(owner, {"step": 3}, expiration)
    forged_value = dataclasses.replace(good, value=good.value.replace(MSGPackSerializer.dumps({"step": 3}), b"\x81"))
    later = dataclasses.replace(good, expiration_time=expiration + 5)  # a signature for another expiration
    other_owner = dataclasses.replace(good, subkey=reader.local_public_key)  # signed by someone else
    for record in (good, forged_value, later, other_owner):
        assert reader.validate(record) == plain.validate(record)
    assert reader.validate(good) and not reader.validate(later) and not reader.validate(other_owner)
    checked = reader.checked
    for _ in range(5):  # the same record from five replicas: verified once
        assert reader.validate(dataclasses.replace(good)) and not reader.validate(later)
    assert reader.checked == checked


def test_the_memory_is_bounded_and_forgets_the_oldest_first():
    owner = load_identity(None).validator
    reader = SignatureMemoValidator(load_identity(None).key, memory=3)
    expiration = get_dht_time() + 10
    records = [signed_record(owner, {"step": step}, expiration) for step in range(5)]
    for record in records:
        assert reader.validate(record)
    assert len(reader.verdicts) == 3 and reader.checked == 5
    assert reader.validate(records[-1]) and reader.checked == 5  # still kept
    assert reader.validate(records[0]) and reader.checked == 6  # forgotten, verified again


def test_records_that_differ_only_in_where_their_bytes_split_have_different_digests():
    first = DHTRecord(b"ab", b"c", b"d", 1.0)
    second = DHTRecord(b"a", b"bc", b"d", 1.0)
    assert record_digest(first) != record_digest(second)
    assert record_digest(first) == record_digest(DHTRecord(b"ab", b"c", b"d", 1.0))
    assert record_digest(first) != record_digest(DHTRecord(b"ab", b"c", b"d", 2.0))
