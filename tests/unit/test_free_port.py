"""The launcher's store port: free, and outside the range outgoing connections draw from.

A port from ``bind(0)`` lies in the kernel's ephemeral range, where the source ports of every
outgoing connection on the host come from (other jobs' gloo connections): a job started while
another one runs could find its store port taken (EADDRINUSE). The wrong fix this catches is
``bind(0)`` itself.
"""

from __future__ import annotations

import socket

import pytest
from script_modules import script_module

pytestmark = pytest.mark.varies_with()


def test_the_store_port_is_free_and_below_the_ephemeral_range():
    with script_module("run_with_restarts") as runner:
        low = runner._ephemeral_low()
        ports = {runner.free_port() for _ in range(8)}
    assert all(max(1024, low - runner.PORT_SPAN) <= port < low for port in ports)
    assert len(ports) > 1  # drawn, not one fixed port every job would collide on
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
