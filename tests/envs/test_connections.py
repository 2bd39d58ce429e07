"""`envs.connections`: the connection limits every clawgym HTTP server is served with. Their
behaviour on real sockets is tested per server (tests/envs/openenv/test_limits.py, the
proxy's and the Tinker server's hardening tests); here, the class that carries them."""

from __future__ import annotations

import pytest

from envs.connections import TimedHttpProtocol, timed_protocol


def test_timed_protocol_carries_its_limits_and_leaves_the_base_alone():
    made = timed_protocol(TimedHttpProtocol, 0.5, 2.0)
    assert issubclass(made, TimedHttpProtocol) and made is not TimedHttpProtocol
    assert (made.idle_timeout_s, made.request_timeout_s) == (0.5, 2.0)
    assert (TimedHttpProtocol.idle_timeout_s, TimedHttpProtocol.request_timeout_s) == (30, 60)


@pytest.mark.parametrize("idle, slow", [(0, 1), (1, -1), (float("nan"), 1)])
def test_limits_that_are_not_positive_are_refused(idle, slow):
    with pytest.raises(ValueError, match="must be positive"):
        timed_protocol(TimedHttpProtocol, idle, slow)
