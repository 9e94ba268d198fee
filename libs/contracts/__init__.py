"""Every message on the wire (AMQP, WebSocket) and every HTTP body, as msgspec Structs."""

from libs.contracts.amqp import (
    MESSAGE_TYPES,
    LifecycleEvent,
    MonitorResult,
    ProjectionRebuild,
    message_type,
)
from libs.contracts.common import ContractError, decode_json, encode
from libs.contracts.wire import Heartbeat, HeartbeatAck, Hello, TaskAvailable, TaskControl

__all__ = [
    "MESSAGE_TYPES", "ContractError", "Heartbeat", "HeartbeatAck", "Hello", "LifecycleEvent", "MonitorResult",
    "ProjectionRebuild", "TaskAvailable", "TaskControl", "decode_json", "encode", "message_type",
]
