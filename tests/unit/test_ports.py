"""Tests that open ports take them race-free: helpers.free_port holds the port until the test ends, and the servers
the tests start (torch's TCPStore: c10d's env:// rendezvous, torchrun's, moetune.sync) can still serve on it."""

import socket

import pytest
import torch.distributed as dist

import helpers
from helpers import free_port


def test_a_free_port_cannot_be_taken_by_another_socket_before_use():
    port = free_port()
    with socket.socket() as other, pytest.raises(OSError, match="in use"):
        other.bind(("127.0.0.1", port))  # what another process's server would do between choice and use


@pytest.mark.parametrize("use_libuv", [True, False])
def test_a_tcpstore_serves_on_a_held_port(use_libuv):
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, 2, True, wait_for_workers=False, use_libuv=use_libuv)
    client = dist.TCPStore("127.0.0.1", port, 2, False)
    client.set("k", "v")
    assert server.get("k") == b"v"


def test_held_ports_are_released_when_the_test_ends():
    free_port()
    assert helpers._held_ports
    helpers.release_ports()
    assert not helpers._held_ports
