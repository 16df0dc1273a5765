"""Which path each peer's snapshots take (dpwa/gossip/transfer/paths.py): one place decides, and learns."""

from __future__ import annotations

import pytest

from dpwa.gossip.transfer.paths import BULK_PAUSE_MAX_S, BULK_PAUSE_S, PeerPaths


def test_a_same_host_peer_goes_by_slot_a_stream_peer_by_stream_and_any_other_by_message():
    paths = PeerPaths(slots=["near"], stream_hosts={"far": "10.0.0.2"})
    assert [paths.incoming(p, 0.0) for p in ("near", "far", "other")] == ["slot", "stream", "message"]
    assert [paths.outgoing(p, 0.0) for p in ("near", "far", "other")] == ["slot", "stream", "message"]
    assert paths.host("far") == "10.0.0.2" and paths.host("near") is None and paths.offers_streams()


def test_a_node_nobody_can_dial_reads_streams_but_offers_none():
    paths = PeerPaths(stream_hosts={"far": "10.0.0.2"}, offers_streams=False)
    assert paths.incoming("far", 0.0) == "stream" and paths.outgoing("far", 0.0) == "message"
    assert not paths.offers_streams()


def test_a_failed_stream_pauses_streams_with_that_peer_doubling_and_a_success_resets_it():
    paths = PeerPaths(stream_hosts={"far": "h"})
    assert paths.stream_failed("far", 100.0) == (BULK_PAUSE_S, 1)
    assert paths.incoming("far", 100.0 + BULK_PAUSE_S - 0.01) == "message"
    assert paths.outgoing("far", 100.0 + BULK_PAUSE_S - 0.01) == "message"
    assert paths.incoming("far", 100.0 + BULK_PAUSE_S) == "stream"
    assert paths.stream_failed("far", 200.0) == (2 * BULK_PAUSE_S, 2)
    for _ in range(20):
        pause, _ = paths.stream_failed("far", 300.0)
    assert pause == BULK_PAUSE_MAX_S
    paths.stream_worked("far")
    assert paths.stream_failed("far", 400.0) == (BULK_PAUSE_S, 1)


@pytest.mark.parametrize("reason, kept", [("shm_stale", True), ("shm_busy", True), ("shm_unavailable", False)])
def test_a_peer_that_refuses_our_slot_gets_the_payload_unless_it_failed_only_this_once(reason, kept):
    paths = PeerPaths(slots=["near"])
    assert paths.refused("slot", {"near": reason}) == (set() if kept else {"near"})
    assert paths.outgoing("near", 0.0) == ("slot" if kept else "message")
    assert paths.incoming("near", 0.0) == "slot"  # we still read its slot: that is its own to refuse


def test_a_peer_that_refuses_our_stream_gets_the_payload_and_one_whose_slots_cannot_open_is_read_by_message():
    paths = PeerPaths(slots=["near"], stream_hosts={"far": "h"})
    assert paths.refused("stream", {"far": "bulk_unavailable"}) == {"far"}
    assert paths.refused("stream", {"far": "bulk_unavailable"}) == set()  # dropped once
    assert paths.outgoing("far", 0.0) == "message" and paths.incoming("far", 0.0) == "stream"
    paths.slot_unreadable("near")
    assert paths.incoming("near", 0.0) == "message" and not paths.reads_slot("near")
