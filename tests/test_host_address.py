"""Which address of this host other hosts reach (starter/host_address.py): what torchft's groups publish and where
gloo binds, where the host's name resolves to loopback (tests/hosts.py runs the same across real network stacks)."""

import logging
import socket

import pytest
from omegaconf import OmegaConf

from starter import host_address
from starter.errors import UserError

ETH0 = {"lo": "127.0.0.1", "eth0": "198.18.0.7"}


@pytest.fixture
def loopback_name(monkeypatch):
    """This host's name resolving to loopback (Debian's /etc/hosts), no GLOO_SOCKET_IFNAME, no MASTER_ADDR."""
    monkeypatch.setattr(socket, "gethostname", lambda: "localhost")
    for name in ("GLOO_SOCKET_IFNAME", "MASTER_ADDR", "TORCHFT_LIGHTHOUSE", "STARTER_REPLICA_HOST"):
        monkeypatch.setenv(name, "")  # what the code under test sets is undone after, as what it was
        monkeypatch.delenv(name)


def test_the_address_published_is_the_one_named_else_the_route_to_the_peers_else_the_only_interface(
    loopback_name, monkeypatch
):
    assert host_address.this_host("10.1.2.3", "127.0.0.1") == ("10.1.2.3", "named")
    assert host_address.this_host(None, "127.0.0.1") == ("127.0.0.1", "the route to 127.0.0.1")
    monkeypatch.setattr(host_address, "interfaces", lambda: ETH0)
    assert host_address.this_host(None, None) == ("198.18.0.7", "this host's only interface")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0")
    assert host_address.this_host(None, None) == ("198.18.0.7", "GLOO_SOCKET_IFNAME=eth0")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    monkeypatch.setattr(host_address, "interfaces", lambda: {**ETH0, "eth1": "198.19.0.7"})
    assert host_address.this_host(None, None) == (None, "")  # which one the others reach: nothing says


def test_gloo_binds_to_the_interface_that_holds_the_address_the_peers_reach_or_one_line_says_what_to_set(
    loopback_name, monkeypatch
):
    monkeypatch.setattr(host_address, "interfaces", lambda: ETH0)
    monkeypatch.setattr(host_address.socket, "gethostbyname", lambda host: {"localhost": "127.0.0.1"}.get(host, host))
    host_address.choose_gloo_device("127.0.0.1")  # the peers on loopback too: nothing to choose
    assert "GLOO_SOCKET_IFNAME" not in host_address.os.environ
    host_address.choose_gloo_device("198.18.0.7")
    assert host_address.os.environ["GLOO_SOCKET_IFNAME"] == "eth0"
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    with pytest.raises(UserError) as refused:
        host_address.choose_gloo_device("198.18.0.9")
    assert str(refused.value) == (
        "this host's name (localhost) resolves to loopback and no interface of it holds 198.18.0.9, where its peers"
        " reach it; set GLOO_SOCKET_IFNAME to the interface they reach (e.g. eth0)"
    )


def test_a_group_that_cannot_know_the_address_others_reach_says_so_in_one_line(loopback_name, monkeypatch, caplog):
    from starter.strategies.torchft_setup import publish_where_reached, reached_at

    monkeypatch.setattr(host_address, "interfaces", lambda: {**ETH0, "eth1": "198.19.0.7"})
    ft = OmegaConf.create(dict(host=None, lighthouse=None, replica_group=0, replica_groups=2))
    with caplog.at_level(logging.INFO, logger="starter.strategies.fault_tolerant"):
        publish_where_reached(ft)
    assert reached_at() == "127.0.0.1" and "MASTER_ADDR" not in host_address.os.environ
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        "replica group 0 is reached at 127.0.0.1 only (this host's name resolves to loopback and it has several"
        " interfaces or none): groups on other hosts cannot join it; set fault_tolerance.host to the address they"
        " reach it at"
    ]
    ft.host = "198.19.0.7"  # named: published, the group's store there, gloo on its interface
    publish_where_reached(ft)
    assert reached_at() == "198.19.0.7" and host_address.os.environ["MASTER_ADDR"] == "198.19.0.7"
    assert host_address.os.environ["GLOO_SOCKET_IFNAME"] == "eth1"
