"""Issue 50's flaky link, end to end: three nodes in the default mode, every link through a proxy that delays
each reply chunk 150 to 450 ms around a 300 ms deadline and cuts a connection about every 6 s on each link,
each node stepping in a thread of its own (dpwa_lab.bench.flaky). Before deadlines followed the link and
channels outlived a timeout, the same scenario applied no exchange at all in 750 node-steps, seeds 0, 1
and 2 (11 in the issue's own run): the nodes rested each other and went silent. python -m dpwa.bench
--flaky runs it for 250 steps; this is a shorter run of it."""

from __future__ import annotations

import pytest

from dpwa_lab.bench.flaky import FlakyLink, flaky_run


@pytest.mark.io
@pytest.mark.timeout(240)
def test_a_link_whose_delays_straddle_the_deadline_still_averages_and_keeps_the_sum():
    """100 steps: at least 2 exchanges applied (runs here on a quiet machine: 10 to 44 in 100 steps, 50 to 56
    in 250; beside the rest of the suite in CI, 4; before: none in 250), as many halves on the serving sides as on the requesting ones, the sum of
    the models exact to float rounding although connections were cut mid-exchange, timeouts of peers heard
    from meanwhile counted slow (not rested for), and no node 10 s without starting or serving an exchange
    (runs: 1.6 to 3.2 s; a rested peer used to be left alone for up to 30 s)."""
    run = flaky_run(seed=0, steps=100)
    assert run.cuts >= 2, run  # the link did cut
    assert run.applied >= 2, run
    assert run.silent_s < 10.0, run
    assert run.applied == run.mirrored, run
    assert run.drift < 1e-4, run
    assert run.slow > 0, run  # timeouts of peers that were heard from: counted slow, not rested for


@pytest.mark.io
def test_the_flaky_link_delays_in_order_and_cuts(tmp_path):
    """The proxy itself: bytes come back in order, each chunk held within the delays asked, and a cut
    closes the connections through it."""
    import socket
    import threading
    import time

    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def echo() -> None:
        conn, _ = server.accept()
        with conn:
            while data := conn.recv(1 << 16):
                conn.sendall(data)

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    link = FlakyLink(port, seed=1, delay_lo_s=0.05, delay_hi_s=0.1, cut_every_s=None)
    try:
        client = socket.create_connection(("127.0.0.1", link.port), timeout=5)
        started = time.monotonic()
        got = b""
        for i in range(5):
            client.sendall(bytes([i]) * 10)
            while len(got) < 10 * (i + 1):
                got += client.recv(1 << 16)
        took = time.monotonic() - started
        assert got == b"".join(bytes([i]) * 10 for i in range(5))
        assert 0.25 <= took < 5.0  # five round trips, each held 50 to 100 ms on the way back
        link._cut_all()
        assert client.recv(1 << 16) == b""  # cut: the connection is closed
        client.close()
    finally:
        link.close()
        server.close()
        thread.join(5)
