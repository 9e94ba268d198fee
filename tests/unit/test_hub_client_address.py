"""The address a WebSocket upgrade counts against: the peer, or behind trusted proxies the right-most
X-Forwarded-For address that is not one (HUB_TRUSTED_PROXIES)."""

from __future__ import annotations

import ipaddress

import pytest

from libs.config import ConfigError, Settings
from services.dispatch_hub.logic import IPNetwork, address_bucket, client_address, parse_address

INGRESS = (ipaddress.ip_network("10.42.0.0/16"),)
CHAIN = (ipaddress.ip_network("10.42.0.0/16"), ipaddress.ip_network("192.0.2.0/24"), ipaddress.ip_network("fd00::/8"))


@pytest.mark.parametrize(("peer", "xff", "trusted", "expected"), [
    # No trusted proxies (the default): X-Forwarded-For is never read.
    ("203.0.113.7", ["198.51.100.1"], (), "203.0.113.7"),
    ("10.42.0.5", ["198.51.100.1"], (), "10.42.0.5"),
    (None, ["198.51.100.1"], (), "unknown"),
    # An untrusted peer that sends X-Forwarded-For: a spoof, ignored.
    ("203.0.113.7", ["198.51.100.1"], INGRESS, "203.0.113.7"),
    ("203.0.113.7", ["10.42.0.9, 198.51.100.1"], INGRESS, "203.0.113.7"),
    # The ingress (trusted) appended the client's address: that one, whatever the client put left of it.
    ("10.42.0.5", ["198.51.100.1"], INGRESS, "198.51.100.1"),
    ("10.42.0.5", ["1.1.1.1, 8.8.8.8, 198.51.100.1"], INGRESS, "198.51.100.1"),
    ("10.42.0.5", ["made-up, 198.51.100.1"], INGRESS, "198.51.100.1"),
    # A chain of trusted proxies: skipped right to left, the first untrusted address counts.
    ("10.42.0.5", ["1.1.1.1, 198.51.100.1, 192.0.2.10"], CHAIN, "198.51.100.1"),
    ("fd00::5", ["198.51.100.1, 10.42.3.3, 192.0.2.10"], CHAIN, "198.51.100.1"),
    ("10.42.0.5", ["1.1.1.1", "198.51.100.1, 192.0.2.10"], CHAIN, "198.51.100.1"),  # headers in order, joined
    # A client spoofing a trusted address on the left gains nothing: the entry the proxy wrote decides.
    ("10.42.0.5", ["10.42.9.9, 198.51.100.1"], INGRESS, "198.51.100.1"),
    # Every entry trusted: the left-most (a hop inside the cluster).
    ("10.42.0.5", ["192.0.2.10, 10.42.0.7"], CHAIN, "192.0.2.10"),
    # A trusted peer without X-Forwarded-For, or with garbage where a hop should be: the last trusted hop,
    # never a bucket the sender names.
    ("10.42.0.5", [], INGRESS, "10.42.0.5"),
    ("10.42.0.5", ["", " , "], INGRESS, "10.42.0.5"),
    ("10.42.0.5", ["198.51.100.1, whatever-i-like"], INGRESS, "10.42.0.5"),
    ("10.42.0.5", ["1.1.1.1, not-an-ip, 192.0.2.10"], CHAIN, "192.0.2.10"),
    # Spellings: ports, brackets, IPv6 and IPv4-mapped IPv6 are normalised (one client, one bucket).
    ("10.42.0.5", ["198.51.100.1:51234"], INGRESS, "198.51.100.1"),
    ("10.42.0.5", ["[2001:db8::0001]:443"], INGRESS, "2001:db8::1"),
    ("10.42.0.5", ["2001:DB8:0:0::1"], INGRESS, "2001:db8::1"),
    ("::ffff:10.42.0.5", ["::ffff:198.51.100.1"], INGRESS, "198.51.100.1"),
])
def test_the_client_address_is_the_rightmost_untrusted_one(peer: str | None, xff: list[str],
                                                            trusted: tuple[IPNetwork, ...], expected: str) -> None:
    assert client_address(peer, xff, trusted) == expected


def test_an_unparsable_peer_is_its_own_key() -> None:
    assert client_address("not-an-address", ["198.51.100.1"], INGRESS) == "not-an-address"


@pytest.mark.parametrize(("raw", "expected"), [
    ("198.51.100.1", "198.51.100.1"), (" 198.51.100.1 ", "198.51.100.1"), ("198.51.100.1:80", "198.51.100.1"),
    ("::1", "::1"), ("[::1]", "::1"), ("[::1]:80", "::1"), ("::ffff:1.2.3.4", "1.2.3.4"),
    ("", None), ("unknown", None), ("1.2.3", None), ("[::1", None), ("1.2.3.4:80:90", None), ("_hidden", None),
])
def test_parse_address(raw: str, expected: str | None) -> None:
    parsed = parse_address(raw)
    assert (str(parsed) if parsed is not None else None) == expected


def test_trusted_proxies_setting_parses_addresses_and_cidrs() -> None:
    settings = Settings.from_env(env={"HUB_TRUSTED_PROXIES": " 10.42.0.0/16, 192.0.2.1 ,fd00::/8,"})
    assert settings.trusted_proxy_networks() == (
        ipaddress.ip_network("10.42.0.0/16"), ipaddress.ip_network("192.0.2.1/32"), ipaddress.ip_network("fd00::/8"))
    assert Settings.from_env(env={}).trusted_proxy_networks() == ()


@pytest.mark.parametrize("raw", ["ingress", "10.42.0.0/33", "10.42.0.1/16", "10.42.0.0/16;10.43.0.0/16"])
def test_a_trusted_proxies_entry_that_is_no_cidr_is_refused(raw: str) -> None:
    with pytest.raises(ConfigError, match="HUB_TRUSTED_PROXIES"):
        Settings.from_env(env={"HUB_TRUSTED_PROXIES": raw})


@pytest.mark.parametrize(("address", "bucket"), [
    ("203.0.113.7", "203.0.113.7"),
    ("2001:db8:1:2::7", "2001:db8:1:2::/64"),
    ("2001:db8:1:2:ffff:ffff:ffff:ffff", "2001:db8:1:2::/64"),  # the same /64: one budget
    ("2001:db8:1:3::7", "2001:db8:1:3::/64"),  # the next /64: another
    ("unknown", "unknown"),
])
def test_an_ipv6_client_draws_on_its_64s_budget(address: str, bucket: str) -> None:
    assert address_bucket(address) == bucket
