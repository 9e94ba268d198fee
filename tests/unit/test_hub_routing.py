"""Which key a dispatch event is published with: towards its client's hub, else unchanged."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from libs.mq import hub_routing
from libs.mq.topology import DISPATCH, LIFECYCLE


@dataclass
class _Event:
    exchange: str
    routing_key: str
    tenant_id: int | None = 1


def test_dispatch_events_go_to_their_clients_hub_and_others_keep_their_key() -> None:
    here, nowhere = uuid.uuid4(), uuid.uuid4()
    events = [_Event(DISPATCH, f"monitor.high.{here}"), _Event(DISPATCH, f"publish.{here}"),
              _Event(DISPATCH, f"monitor.control.{nowhere}", tenant_id=2), _Event(LIFECYCLE, "client.online"),
              _Event(DISPATCH, "monitor.high.not-a-uuid")]
    assert hub_routing.clients_to_resolve(events, DISPATCH) == {here: 1, nowhere: 2}
    hubs = {here: "pod-a.7"}
    keys = [hub_routing.routed_key(e, DISPATCH, hubs) for e in events]
    assert keys == [f"hub.pod-a_7.monitor.high.{here}", f"hub.pod-a_7.publish.{here}",
                    f"monitor.control.{nowhere}", "client.online", "monitor.high.not-a-uuid"]
    assert hub_routing.hub_binding("pod-a.7") == "hub.pod-a_7.#"
    assert hub_routing.client_of_dispatch_key(keys[0]) == here


def test_a_hub_id_never_becomes_a_wildcard_or_more_than_one_word() -> None:
    for hub in ("a.b", "a*b", "a#b", "", "#", "*.*"):
        word = hub_routing.hub_word(hub)
        assert word and "." not in word and "*" not in word and "#" not in word, hub
