"""The store the trainer channel runs on: the KVStore contract on every
backend (dict, HashStore, FileStore, TCPStore), the TCPStore sharp edges the
design relies on or avoids (checked against torch itself), and the channel's
tagging, size checks and purging."""

import datetime
import threading

import pytest
import torch.distributed as dist

from resident_trainer.integrations.torchdist.store import TorchKVStore
from resident_trainer.protocol.channel import ACK, DECISION, REPORT, SEAL, Record, TrainerChannel
from resident_trainer.protocol.errors import ChannelError, RecordTooLarge, StoreTimeout
from resident_trainer.protocol.store import COUNTER_PREFIX, MAX_VALUE_BYTES, SENTINEL, MemoryKVStore

TIMEOUT = datetime.timedelta(seconds=5)


def _tcp_server():
    return dist.TCPStore("127.0.0.1", 0, 1, True, timeout=TIMEOUT, wait_for_workers=False)


@pytest.fixture(params=["memory", "hash", "file", "tcp"])
def kv(request, tmp_path):
    if request.param == "memory":
        yield MemoryKVStore()
    elif request.param == "hash":
        yield TorchKVStore(dist.HashStore())
    elif request.param == "file":
        yield TorchKVStore(dist.FileStore(str(tmp_path / "filestore"), 1))
    else:
        server = _tcp_server()
        yield TorchKVStore(server)
        del server


# --- the KVStore contract, identical on every backend -------------------------------------


def test_get_of_an_absent_key_is_none_and_returns_at_once(kv):
    assert kv.get("nothing/here") is None
    kv.set("k", b"v")
    assert kv.get("k") == b"v"
    kv.delete("k")
    assert kv.get("k") is None
    kv.delete("k")  # deleting an absent key is fine


def test_create_is_once_and_names_the_winner(kv):
    assert kv.create("slot", b"first") == b"first"
    assert kv.create("slot", b"second") == b"first"
    assert kv.get("slot") == b"first"
    assert kv.create("slot", b"first") == b"first"  # a retried create recognises itself


def test_counters_are_separate_from_plain_keys(kv):
    assert kv.add(COUNTER_PREFIX + "n", 1) == 1
    assert kv.add(COUNTER_PREFIX + "n", 5) == 6
    with pytest.raises(ValueError, match="counter"):
        kv.add("plain", 1)
    with pytest.raises(ValueError, match="counter"):
        kv.set(COUNTER_PREFIX + "n", b"1")
    with pytest.raises(ValueError, match="counter"):
        kv.create(COUNTER_PREFIX + "m", b"1")


def test_values_are_checked_before_anything_is_sent(kv):
    with pytest.raises(RecordTooLarge, match=str(MAX_VALUE_BYTES)):
        kv.set("big", b"x" * (MAX_VALUE_BYTES + 1))
    with pytest.raises(ValueError, match="empty"):
        kv.set("e", b"")
    with pytest.raises(ValueError, match="sentinel"):
        kv.set("s", SENTINEL)
    with pytest.raises(TypeError, match="bytes"):
        kv.set("t", "text")
    with pytest.raises(ValueError, match="whitespace"):
        kv.get("a key")
    # The refusal did not hurt the connection.
    kv.set("after", b"ok")
    assert kv.get("after") == b"ok"


def test_the_largest_value_goes_through(kv):
    kv.set("max", b"y" * MAX_VALUE_BYTES)
    assert len(kv.get("max")) == MAX_VALUE_BYTES


def test_wait_reports_presence_within_its_timeout(kv):
    kv.set("here", b"1")
    assert kv.wait(["here"], 1.0)
    if isinstance(kv, MemoryKVStore):
        assert not kv.wait(["missing"], 0.05)
    else:
        assert not kv.wait(["missing"], 0.1)


# --- TCPStore's sharp edges, verified against torch itself ----------------------------------


@pytest.mark.parametrize("backend", ["hash", "file", "tcp"])
def test_compare_set_on_an_absent_key_returns_expected_and_sets_nothing(backend, tmp_path):
    st = {"hash": dist.HashStore, "file": lambda: dist.FileStore(str(tmp_path / "fs"), 1), "tcp": _tcp_server}[
        backend
    ]()
    # The edge: the return value cannot tell absent from present-and-equal ...
    assert st.compare_set("k", b"expected", b"new") == b"expected"
    assert not st.check(["k"])
    # ... which makes compare_set(k, SENTINEL, SENTINEL) a non-blocking read,
    st.set("k", b"v")
    assert st.compare_set("k", SENTINEL, SENTINEL) == b"v"
    assert st.compare_set("absent", SENTINEL, SENTINEL) == SENTINEL
    # and an empty expected value an atomic create-once.
    assert st.compare_set("c", b"", b"mine") == b"mine"
    assert st.compare_set("c", b"", b"theirs") == b"mine"


def test_tcpstore_add_on_a_set_key_breaks_the_client_for_good():
    server = _tcp_server()
    client = dist.TCPStore("127.0.0.1", server.port, 1, False, timeout=datetime.timedelta(seconds=2))
    client.set("plain", b"hello")
    with pytest.raises(dist.DistNetworkError):
        client.add("plain", 1)
    with pytest.raises(dist.DistNetworkError):
        client.get("plain")
    # The adapter never issues that add, and a fresh clone talks again.
    kv = TorchKVStore(server)
    with pytest.raises(ValueError, match="counter"):
        kv.add("plain", 1)
    assert kv.get("plain") == b"hello"


def test_tcpstore_drops_the_connection_on_an_oversized_payload():
    server = _tcp_server()
    client = dist.TCPStore("127.0.0.1", server.port, 1, False, timeout=datetime.timedelta(seconds=2))
    with pytest.raises(dist.DistError):
        client.set("big", b"x" * (MAX_VALUE_BYTES + 1))
    with pytest.raises(dist.DistError):
        client.get("anything")


def test_tcpstore_num_keys_is_not_per_prefix():
    server = _tcp_server()
    server.set("other/a", b"1")
    prefixed = dist.PrefixStore("rt", server)
    prefixed.set("b", b"2")
    # A PrefixStore counts the whole store, so a job's keys cannot be counted,
    # only enumerated (TrainerChannel.job_keys).
    assert prefixed.num_keys() == server.num_keys() >= 2


def test_tcpstore_get_of_an_absent_key_blocks_until_the_timeout_but_ours_does_not():
    server = _tcp_server()
    client = dist.TCPStore("127.0.0.1", server.port, 1, False, timeout=datetime.timedelta(milliseconds=300))
    with pytest.raises(dist.DistStoreError):
        client.get("absent")
    assert TorchKVStore(client).get("absent") is None


def test_each_thread_talks_through_its_own_clone():
    server = _tcp_server()
    kv = TorchKVStore(server)
    clients, errors = set(), []

    def work(i):
        try:
            for j in range(50):
                kv.set(f"t{i}/{j}", str(j).encode())
                assert kv.get(f"t{i}/{j}") == str(j).encode()
                kv.add(f"{COUNTER_PREFIX}hits", 1)
            clients.add(id(kv.client()))
        except BaseException as exc:  # collected for the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(clients) == 4
    assert kv.add(f"{COUNTER_PREFIX}hits", 0) == 200


def test_store_errors_are_classified():
    server = _tcp_server()
    client = dist.TCPStore("127.0.0.1", server.port, 1, False, timeout=datetime.timedelta(milliseconds=200))
    kv = TorchKVStore(client, use_clones=False)
    assert not kv.wait(["never"], 0.1)
    raw = dist.TCPStore("127.0.0.1", server.port, 1, False, timeout=datetime.timedelta(milliseconds=200))
    with pytest.raises(dist.DistStoreError):
        raw.wait(["never"], datetime.timedelta(milliseconds=50))
    with pytest.raises(StoreTimeout):
        TorchKVStore(client, use_clones=False).call("get", lambda c: c.get("never"))


# --- the trainer channel ------------------------------------------------------------------


def test_records_roundtrip_with_their_tags(kv):
    ch = TrainerChannel(kv, group="g1", world=3)
    rec = Record(7, 2, REPORT, 1, {"abort": None, "x": [1, 2]})
    key = ch.post(rec)
    assert key == "rt/g1/j7/report/2/1"
    assert ch.read(7, 2, REPORT, 1) == rec
    assert ch.read(7, 2, REPORT, 2) is None


def test_a_record_under_the_wrong_key_is_refused():
    kv = MemoryKVStore()
    ch = TrainerChannel(kv, group="g1", world=2)
    ch.post(Record(1, 0, REPORT, 1, {}))
    kv.set(ch.key(1, 1, REPORT, 1), kv.get(ch.key(1, 0, REPORT, 1)))
    with pytest.raises(ChannelError, match="tagged"):
        ch.read(1, 1, REPORT, 1)
    kv.set(ch.key(1, 2, REPORT, 1), b"not json")
    with pytest.raises(ChannelError, match="not a channel record"):
        ch.read(1, 2, REPORT, 1)


def test_claims_decide_once():
    ch = TrainerChannel(MemoryKVStore(), group="g", world=2)
    head = ch.claim(Record(1, 3, DECISION, 0, {"v": "train", "by": 0}))
    late = ch.claim(Record(1, 3, DECISION, 0, {"v": "abort", "by": 1}))
    assert head.body == late.body == {"v": "train", "by": 0}


def test_oversized_records_name_their_tags():
    ch = TrainerChannel(MemoryKVStore(), group="g", world=2)
    with pytest.raises(RecordTooLarge, match=r"job=4, seq=1, name='report', rank=1"):
        ch.post(Record(4, 1, REPORT, 1, {"blob": "x" * MAX_VALUE_BYTES}))


@pytest.mark.parametrize("bad", [dict(job=-1), dict(seq=-2), dict(name="chat"), dict(rank=True)])
def test_bad_tags_are_refused(bad):
    ch = TrainerChannel(MemoryKVStore(), group="g", world=2)
    tags = {"job": 1, "seq": 0, "name": REPORT, "rank": 1, **bad}
    with pytest.raises(ValueError, match=next(iter(bad))):
        ch.key(**tags)


def test_purge_leaves_no_key_of_the_job(kv):
    ch = TrainerChannel(kv, group="g2", world=3)
    last = 5
    for seq in range(SEAL, last + 1):
        ch.claim(Record(9, seq, DECISION, 0, {"v": "train", "by": 0}))
        for r in (1, 2):
            ch.post(Record(9, seq, REPORT, r, {}))
            ch.post(Record(9, seq, ACK, r, {}))
    ch.post(Record(10, 0, REPORT, 1, {}))
    ch.purge(9, last)
    assert all(kv.get(k) is None for k in ch.job_keys(9, last))
    assert ch.read(10, 0, REPORT, 1) is not None
    if isinstance(kv, MemoryKVStore):
        assert kv.keys() == [ch.key(10, 0, REPORT, 1)]


def test_closed_marker_keeps_recent_outcomes():
    ch = TrainerChannel(MemoryKVStore(), group="g", world=2)
    assert ch.closed() == -1
    marker = None
    for job in range(1, 30):
        marker = ch.set_closed(job, "abort" if job % 2 else "publish", job, marker)
    got = ch.closed_marker()
    assert got.job == 29 and ch.closed() == 29
    assert got.outcomes[29] == ("abort", 29) and got.outcomes[28] == ("publish", 28)
    assert len(got.outcomes) == 16 and 13 not in got.outcomes
