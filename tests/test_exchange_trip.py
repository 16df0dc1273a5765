"""One symmetric exchange's trip through the package (issue 47): scripts/exchange-trip.py, held.

The script records, on every thread, each call into dpwa/ from one node's update_send to its peer's
update_wait that applies the mirrored half. Its spine is every file on the call stack each time the exchange's
state machine takes an event or the mixing rule applies a half: the files the exchange passes through, as
opposed to those it consults and returns from (counters, the clock, flow control, codecs). docs/design.md,
'One exchange's trip', quotes the figures.
"""

from __future__ import annotations

import importlib.util
import sys
import threading

import pytest

from conftest import ROOT

pytestmark = pytest.mark.io

SPINE_GOSSIP_MAX = 8  # the bound, for the files of dpwa/gossip/ on the spine
SPINE_MAX = 10  # measured: five of dpwa/gossip/, the rule's three (its check, its base, the rule), the wire's two


def test_one_symmetric_exchange_passes_through_at_most_eight_files_of_the_gossip_package():
    spec = importlib.util.spec_from_file_location("exchange_trip", ROOT / "scripts" / "exchange-trip.py")
    assert spec is not None and spec.loader is not None
    trip = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(trip)
    try:
        averaged = trip.trip()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    assert averaged, "the recorded exchange did not average"
    spine, gossip = sorted(trip.spine), trip.gossip(trip.spine)
    # the measure finds what it must: the node, the mode, the driver and the machine, and the rule
    for needed in ("node.py", "exchange/symmetric.py", "exchange/driver.py", "exchange/machine.py"):
        assert f"dpwa/gossip/{needed}" in spine, (needed, spine)
    assert any(name.startswith("dpwa/mixing/rules/") for name in spine), spine
    assert set(spine) <= set(trip.files), "the spine holds a file the trip never entered"
    assert len(gossip) <= SPINE_GOSSIP_MAX, f"{len(gossip)} files of dpwa/gossip/ on the spine: {gossip}"
    assert len(spine) <= SPINE_MAX, f"{len(spine)} files on the spine (at most {SPINE_MAX}): {spine}"
