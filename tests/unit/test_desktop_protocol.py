"""The desktop protocol as a product (docs/desktop-protocol.md): the committed AsyncAPI document is what the
contracts generate, every close code the hub can use is in it, version negotiation picks the right major, and
every change since 1.0 is additive (an old client still decodes what the hub sends, and is still understood)."""

from __future__ import annotations

import json
import subprocess
import uuid
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Literal, get_args

import msgspec
import pytest

from libs.contracts import wire
from services.dispatch_hub import asyncapi, connections
from services.dispatch_hub.logic import ProtocolChoice, choose_protocol
from tests.support import protocol_v1
from tests.support.protocol_compat import compatibility_problems

CURRENT_SERVER = tuple(get_args(wire.ServerEvent))
CONTRACTS = asyncapi.COMMITTED.parents[1]


def test_committed_asyncapi_document_is_what_the_contracts_generate() -> None:
    committed = asyncapi.COMMITTED.read_text()
    assert committed == asyncapi.render(asyncapi.asyncapi_document()), (
        "contracts/asyncapi/desktop.json is stale: run `make asyncapi` and commit it")


def test_the_check_command_fails_on_a_stale_document(tmp_path: Path) -> None:
    stale = tmp_path / "desktop.json"
    stale.write_text(asyncapi.COMMITTED.read_text().replace(f'"{wire.PROTOCOL_VERSION}.0"', '"1.1.0"'))
    assert asyncapi.main(["--check", str(stale)]) == 1
    assert asyncapi.main(["--check", str(asyncapi.COMMITTED)]) == 0


def test_every_message_on_the_socket_is_in_the_document() -> None:
    document = asyncapi.asyncapi_document()
    assert set(asyncapi.SERVER_MESSAGES) == set(CURRENT_SERVER)
    assert set(asyncapi.CLIENT_MESSAGES) == {wire.Heartbeat}
    names = {m["name"] for m in document["components"]["messages"].values()}
    assert names == {"hello", "task_available", "task_control", "heartbeat_ack", "error", "heartbeat"}
    sends = {op["messages"][0]["$ref"].rsplit("/", 1)[1] for op in document["operations"].values()
             if op["action"] == "send"}
    assert sends == {cls.__name__ for cls in CURRENT_SERVER}


def test_every_close_code_the_hub_uses_is_documented_once() -> None:
    documented = [c.code for c in asyncapi.CLOSE_CODES]
    assert len(documented) == len(set(documented))
    used = connections.NORMAL_CLOSES | connections.ABNORMAL_CODES | {connections.DROPPED}
    assert used - set(documented) == set(), "document these close codes in services/dispatch_hub/asyncapi.py"


def test_fields_since_names_real_fields_of_the_current_version() -> None:
    structs = {cls.__name__: cls for cls in (*CURRENT_SERVER, wire.Heartbeat)}
    for struct, fields in wire.FIELDS_SINCE.items():
        for name, since in fields.items():
            assert name in structs[struct].__struct_fields__
            major, minor = map(int, since.split("."))
            assert major == wire.PROTOCOL_MAJOR and 0 < minor <= wire.PROTOCOL_MINOR


@pytest.mark.parametrize(("offered", "expected"), [
    ([], ProtocolChoice(major=1)),
    (["monitor.desktop.v1"], ProtocolChoice(major=1, subprotocol="monitor.desktop.v1")),
    (["monitor.desktop.v2, monitor.desktop.v1"], ProtocolChoice(major=1, subprotocol="monitor.desktop.v1")),
    (["monitor.desktop.v2", "monitor.desktop.v1"], ProtocolChoice(major=1, subprotocol="monitor.desktop.v1")),
    (["monitor.desktop.v2"], ProtocolChoice(major=None)),
    (["graphql-ws"], ProtocolChoice(major=None)),
    (["monitor.desktop.v01", "monitor.desktop.v١"], ProtocolChoice(major=None)),  # not spelled as a major
    ([" , "], ProtocolChoice(major=1)),
])
def test_choose_protocol(offered: list[str], expected: ProtocolChoice) -> None:
    assert choose_protocol(offered) == expected


def test_the_highest_served_major_wins() -> None:
    assert choose_protocol(["monitor.desktop.v1, monitor.desktop.v3"], supported=(1, 3)).major == 3
    assert choose_protocol(["monitor.desktop.v1"], supported=(1, 3)).subprotocol == "monitor.desktop.v1"


def test_every_change_since_1_0_is_additive() -> None:
    assert compatibility_problems(protocol_v1.SERVER_MESSAGES, CURRENT_SERVER, "server") == []
    assert compatibility_problems(protocol_v1.CLIENT_MESSAGES, (wire.Heartbeat,), "client") == []


def test_the_compatibility_check_catches_breaking_changes() -> None:
    def hello(**fields: object) -> type[msgspec.Struct]:
        base = {name: (typ, msgspec.field(default=None)) for name, typ in
                [("client_id", uuid.UUID), ("tenant_id", int), ("hub_instance", str), ("server_time", datetime),
                 ("heartbeat_interval_s", int), ("interrupt_generation", int), ("replayed_available", int),
                 ("replayed_controls", int)]}
        spec = [(name, *value) if isinstance(value, tuple) else (name, value) for name, value in
                {**base, **fields}.items() if value is not None]
        return msgspec.defstruct("Hello", spec, tag="hello", tag_field="type", kw_only=True)  # type: ignore[arg-type]

    old = (protocol_v1.Hello,)
    assert compatibility_problems(old, (hello(),), "server") == []
    assert compatibility_problems(old, (hello(tenant_id=None),), "server") == ["hello.tenant_id is gone"]
    assert compatibility_problems(old, (hello(tenant_id=str),), "server") == [
        "hello.tenant_id: shape changed from {'type': 'integer'} to {'type': 'string'}"]
    assert compatibility_problems(old, (), "server") == ["message type 'hello' is gone"]

    lane = Literal["high", "normal", "normal_boosted", "retry", "urgent", "express"]
    fields = [(f.name, lane if f.name == "lane" else f.type) + (() if f.required else (f.default,))
              for f in msgspec.structs.fields(protocol_v1.TaskAvailable)]
    wider = msgspec.defstruct("TaskAvailable", fields, tag="task_available", tag_field="type", kw_only=True)
    problems = compatibility_problems((protocol_v1.TaskAvailable,), (wider,), "server")
    assert problems == ["task_available.lane: new value(s) ['express'] an old client does not know"]

    demanding = msgspec.defstruct("Heartbeat", [("sent_at", datetime), ("must_send", int)],
                                  tag="heartbeat", tag_field="type", kw_only=True)
    problems = compatibility_problems(protocol_v1.CLIENT_MESSAGES, (demanding,), "client")
    assert "heartbeat.must_send is new and required: an old client does not send it" in problems
    assert "heartbeat.platform_health is gone" in problems


def test_an_old_client_decodes_every_message_the_hub_sends_today() -> None:
    """Today's messages, with every field set (the ones added since 1.0 too), decode as 1.0 Structs."""
    now = datetime.now(UTC)
    client, task = uuid.uuid4(), uuid.uuid4()
    today: list[msgspec.Struct] = [
        wire.Hello(client_id=client, tenant_id=1, hub_instance="hub-a", server_time=now, heartbeat_interval_s=10,
                   interrupt_generation=3, replayed_available=1, replayed_controls=1,
                   protocol_version=wire.PROTOCOL_VERSION),
        wire.TaskAvailable(kind="monitor", task_id=task, target_client_id=client, priority=5000, lane="high",
                           scheduler_group_key="qid:1", business_date=date.today(), interrupt_generation=3,
                           updated_at=now, monitor_task_id=7, collect_request_id=uuid.uuid4(),
                           traceparent="00-" + "1" * 32 + "-" + "2" * 16 + "-01"),
        wire.TaskControl(kind="monitor", task_id=task, target_client_id=client, control="interrupt_requested",
                         reason="collect_now_preempt", interrupt_generation=3, replacement_task_id=uuid.uuid4(),
                         updated_at=now, collect_request_id=uuid.uuid4(), traceparent="00-" + "1" * 32 + "-" +
                         "2" * 16 + "-01"),
        wire.HeartbeatAck(server_time=now),
        wire.ErrorEvent(error="invalid_field", message="bad", field="sent_at"),
    ]
    for message in today:
        old = protocol_v1.server_event_decoder.decode(msgspec.json.encode(message))
        assert type(old).__name__ == type(message).__name__
        for name in old.__struct_fields__:
            assert msgspec.to_builtins(getattr(old, name)) == msgspec.to_builtins(getattr(message, name))


def test_the_hub_understands_a_1_0_heartbeat() -> None:
    old = protocol_v1.Heartbeat(sent_at=datetime.now(UTC), platform_health={"openai": "healthy"},
                                local_queue_depth=2, active_task_id=uuid.uuid4(), execution_phase="WAITING")
    decoded = wire.client_message_decoder.decode(msgspec.json.encode(old))
    assert decoded.platform_health == {"openai": "healthy"} and decoded.execution_phase == "WAITING"


def test_the_committed_document_passes_the_asyncapi_validator_and_a_broken_one_does_not(tmp_path: Path) -> None:
    """@asyncapi/parser (what `asyncapi validate` runs), installed by scripts/ensure-node-tools.sh."""
    if not (CONTRACTS / "node_modules" / "@asyncapi" / "parser").is_dir():
        pytest.fail("the AsyncAPI validator is not installed: run `bash scripts/ensure-node-tools.sh`")
    broken = json.loads(asyncapi.COMMITTED.read_text())
    broken["operations"]["sendHello"]["action"] = "publish"  # AsyncAPI 2's word: 3.0 says send or receive
    del broken["components"]["schemas"]["Hello"]  # a dangling $ref
    broken_path = tmp_path / "broken.json"
    broken_path.write_text(json.dumps(broken))
    run = subprocess.run(["node", "validate-asyncapi.mjs", str(asyncapi.COMMITTED), str(broken_path)],
                         cwd=CONTRACTS, capture_output=True, text=True, timeout=120, check=False)
    reports = [json.loads(line) for line in run.stdout.splitlines()]
    assert [r["valid"] for r in reports] == [True, False], run.stdout + run.stderr
    assert run.returncode == 1
    assert reports[0]["problems"] == []


def test_the_protocol_page_lists_every_close_code() -> None:
    page = (CONTRACTS.parent / "docs" / "desktop-protocol.md").read_text()
    table = page[page.index("## Close codes"):]
    missing = [c.code for c in asyncapi.CLOSE_CODES if f"\n| {c.code} |" not in table]
    assert missing == [], f"docs/desktop-protocol.md's close code table lacks {missing}"
