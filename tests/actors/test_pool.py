"""Ray plumbing without a cluster: joining an --address where nothing answers fails fast, naming the address."""

from __future__ import annotations

import socket
import time

import pytest

from specrun.actors.pool import _probe


def test_unreachable_ray_address_fails_fast_with_the_address():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match=rf"cannot reach the Ray cluster at '127.0.0.1:{port}' within 5 s"):
        _probe(f"127.0.0.1:{port}", 5)
    assert time.monotonic() - t0 < 5
    _probe("auto", 5)  # no host:port: left to Ray
