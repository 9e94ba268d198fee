"""Push-lease without I/O (libs/tasks/push_leases.py): the derived token is the hub's kind of token (fenced as a pulled
one), the same for the same task and epoch and nothing else; the hub adds it only to a pushed task_available; the
capability is granted only when asked for and only by a hub that has the key; the key fails closed."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

import msgspec
import pytest

from libs.auth import hash_token
from libs.config import DEV_PUSH_LEASE_SECRET, ConfigError, Settings
from libs.contracts.amqp import LifecycleEvent
from libs.contracts.http import BrandRef, PlatformRef, QuestionRef
from libs.contracts.wire import PUSH_LEASE, Hello, TaskAvailable, TaskControl, requested_capabilities
from libs.outbox.writer import OutboxEvent
from libs.tasks import push_leases
from services.dispatch_hub.logic import LEASE_TOKEN_PREFIX, LeaseCheck, LeaseState, check_lease, lease_token_epoch

KEY = b"k" * 32
TASK = uuid.UUID("6c1f1f2e-0000-4000-8000-000000000001")
CLIENT = uuid.UUID("6c1f1f2e-0000-4000-8000-000000000002")
NOW = datetime(2026, 12, 2, 6, 0, tzinfo=UTC)


def _available(**extra: object) -> TaskAvailable:
    return TaskAvailable(kind="monitor", task_id=TASK, target_client_id=CLIENT, priority=10, lane="high",
                         updated_at=NOW, monitor_task_id=42, **extra)  # type: ignore[arg-type]


def _lease() -> push_leases.PushLease:
    return push_leases.PushLease(
        task_id=TASK, tenant_id=1, target_client_id=CLIENT, monitor_task_id=42, lane="high", ai_platform_id=2,
        collect_request_id=None, lease_epoch=1, lease_expires_at=NOW, brand=BrandRef(brand_id=7, name="Acme"),
        question=QuestionRef(question_id=9, text="best?"), platform=PlatformRef(ai_platform_id=2, code="openai"))


def test_derived_token_is_a_lease_token_of_its_epoch_and_passes_the_fence() -> None:
    token = push_leases.derive_token(KEY, TASK, 1)
    assert push_leases.TOKEN_PREFIX == LEASE_TOKEN_PREFIX
    assert lease_token_epoch(token) == 1
    state = LeaseState(target_client_id=CLIENT, status="in_progress", lease_epoch=1,
                       lease_token_hash=hash_token(token))
    assert check_lease(state, caller=CLIENT, token=token) is LeaseCheck.OK


def test_derived_token_is_the_same_for_the_same_task_and_epoch_only() -> None:
    token = push_leases.derive_token(KEY, TASK, 1)
    assert push_leases.derive_token(KEY, TASK, 1) == token  # a replay hands out the same lease
    others = {push_leases.derive_token(KEY, TASK, 2), push_leases.derive_token(KEY, uuid.uuid4(), 1),
              push_leases.derive_token(b"x" * 32, TASK, 1)}
    assert token not in others and len(others) == 3
    # A token of another key (a hub with the wrong secret) is refused by the fence of the lease it did not issue.
    state = LeaseState(target_client_id=CLIENT, status="in_progress", lease_epoch=1,
                       lease_token_hash=hash_token(token))
    assert check_lease(state, caller=CLIENT, token=push_leases.derive_token(b"x" * 32, TASK, 1)) is LeaseCheck.STALE


def test_the_hub_adds_the_token_to_a_pushed_task_available_only() -> None:
    pushed = msgspec.json.encode(_available(lease_epoch=1, lease_expires_at=NOW))
    text = push_leases.add_token(pushed, KEY)
    assert text is not None
    event = msgspec.json.decode(text, type=TaskAvailable)
    assert event.lease_token == push_leases.derive_token(KEY, TASK, 1)
    assert event.lease_epoch == 1
    assert push_leases.add_token(msgspec.json.encode(_available()), KEY) is None  # queued: lease by pull
    control = TaskControl(kind="monitor", task_id=TASK, target_client_id=CLIENT, control="cancelled", reason="x",
                          interrupt_generation=0, updated_at=NOW)
    assert push_leases.add_token(msgspec.json.encode(control), KEY) is None
    assert push_leases.add_token(b'{"lease_epoch": "not json', KEY) is None


def test_with_leases_puts_the_lease_but_no_token_on_the_event_and_adds_task_leased() -> None:
    other = uuid.uuid4()
    events = [OutboxEvent(exchange="dispatch", routing_key="monitor.high.x", message=_available()),
              OutboxEvent(exchange="dispatch", routing_key="monitor.high.x",
                          message=msgspec.structs.replace(_available(), task_id=other))]
    out = push_leases.with_leases(events, [_lease()])
    first, second, lifecycle = out
    assert isinstance(first.message, TaskAvailable)
    assert first.message.lease_epoch == 1 and first.message.lease_expires_at == NOW
    assert first.message.brand == BrandRef(brand_id=7, name="Acme") and first.message.lease_token is None
    assert second.message == events[1].message  # not pushed: unchanged
    assert isinstance(lifecycle.message, LifecycleEvent) and lifecycle.routing_key == "task.leased"
    assert lifecycle.message.task_id == TASK
    assert push_leases.with_leases(events, []) is events


def test_capabilities_are_the_known_ones_asked_for() -> None:
    assert requested_capabilities(["push_lease"]) == {PUSH_LEASE}
    assert requested_capabilities(["something_new, push_lease ", "x"]) == {PUSH_LEASE}
    assert requested_capabilities([]) == frozenset()
    assert requested_capabilities(["pushlease"]) == frozenset()


def test_an_old_hello_decodes_with_no_capabilities() -> None:
    hello = msgspec.json.decode(b'{"type":"hello","client_id":"6c1f1f2e-0000-4000-8000-000000000002","tenant_id":1,'
                                b'"hub_instance":"h","server_time":"2026-12-02T06:00:00Z","heartbeat_interval_s":10,'
                                b'"interrupt_generation":0}', type=Hello)
    assert hello.capabilities == []


def test_push_lease_key_fails_closed() -> None:
    assert Settings.from_env(env={}).push_lease_key() is None  # off: every client pulls
    with pytest.raises(ConfigError, match="PUSH_LEASE_SECRET"):
        Settings.from_env(env={"PUSH_LEASE_ENABLED": "1"}).push_lease_key()
    with pytest.raises(ConfigError, match="PUSH_LEASE_SECRET"):
        Settings.from_env(env={"PUSH_LEASE_ENABLED": "1", "PUSH_LEASE_SECRET": "short"}).push_lease_key()
    secret = "9f" * 32
    assert Settings.from_env(env={"PUSH_LEASE_ENABLED": "1", "PUSH_LEASE_SECRET": secret}).push_lease_key() == (
        secret.encode())
    assert Settings.from_env(env={"PUSH_LEASE_ENABLED": "1", "DEV_MODE": "1"}).push_lease_key() == (
        DEV_PUSH_LEASE_SECRET.encode())
    with pytest.raises(ConfigError, match="placeholder"):  # deploy/k8s/base/secret.example.yaml's, copied as is
        Settings.from_env(env={"PUSH_LEASE_ENABLED": "1",
                               "PUSH_LEASE_SECRET": "REPLACE_ME_WITH_OUTPUT_OF_OPENSSL_RAND_HEX_32"}).push_lease_key()
    with pytest.raises(ConfigError, match="PUSH_LEASE_TTL_SECONDS"):
        Settings.from_env(env={"PUSH_LEASE_ENABLED": "1", "PUSH_LEASE_TTL_SECONDS": "500"})
    # Pull-only: a lease shorter than the push default (the reconcile and chaos stacks' 3 s) is no error.
    assert Settings.from_env(env={"LEASE_TTL_SECONDS": "3"}).lease_ttl_seconds == 3


def test_a_hub_grants_push_lease_only_with_a_key() -> None:
    from services.dispatch_hub.gateway import Gateway

    def gateway(key: bytes | None, mismatch: str | None = None) -> Gateway:
        gw = Gateway.__new__(Gateway)  # grant() reads only the key and its check: no pool or broker needed
        gw.push_key = key
        gw.push_key_mismatch = mismatch
        return gw

    assert gateway(KEY).grant(["push_lease"]) == {PUSH_LEASE}
    assert gateway(None).grant(["push_lease"]) == frozenset()
    assert gateway(KEY).grant([]) == frozenset()
    # The leader holds another key (push_key_sweep): nothing granted, no token derived.
    assert gateway(KEY, mismatch="0123456789abcdef").grant(["push_lease"]) == frozenset()
    assert gateway(KEY, mismatch="0123456789abcdef").token_key is None and gateway(KEY).token_key == KEY


def test_the_simulator_starts_a_pushed_event_as_the_lease_call_would_have_answered() -> None:
    from tools.desktop_sim.client import pushed_lease

    event = msgspec.to_builtins(_available(lease_token="lt1.1.x", lease_epoch=1, lease_expires_at=NOW,
                                           brand=BrandRef(brand_id=7, name="Acme"),
                                           question=QuestionRef(question_id=9, text="best?"),
                                           platform=PlatformRef(ai_platform_id=2, code="openai")))
    lease = pushed_lease(event)
    assert lease["task_id"] == str(TASK) and lease["lease_token"] == "lt1.1.x" and lease["lease_epoch"] == 1
    assert lease["platform"]["code"] == "openai" and lease["brand"]["name"] == "Acme"
    assert lease["question"]["text"] == "best?" and lease["execution_owner"] == "desktop_tasks"


def test_a_keys_fingerprint_names_it_without_telling_it() -> None:
    key, other = b"push-lease-secret-0123456789-0123456789", b"push-lease-secret-0123456789-0123456780"
    assert push_leases.key_fingerprint(key) == push_leases.key_fingerprint(bytes(key))
    assert push_leases.key_fingerprint(key) != push_leases.key_fingerprint(other)
    fingerprint = push_leases.key_fingerprint(key)
    assert len(fingerprint) == 16 and int(fingerprint, 16) >= 0 and key.hex()[:16] != fingerprint
