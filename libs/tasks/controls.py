"""`task_control`: the server's word to one client about one of its tasks (interrupt, cancel, lease revoked), on
either execution path (docs/architecture.md §13.3, docs/legacy-path.md).

The one way to send it: to `monitor.control.{client}` on the dispatch exchange, through the outbox in the caller's
transaction, ordered per client (`client:{client}`, so a client sees its controls and task_available events in the
order they were decided). A control a click sends is urgent: claimed by the pumps before older normal events.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

from libs.contracts.wire import ControlKind, TaskControl
from libs.db.pool import Conn
from libs.mq.topology import DISPATCH
from libs.outbox import OutboxEvent, enqueue_many

URGENT = 1  # outbox priority of a click's controls


def control_event(*, task_id: uuid.UUID, client_id: uuid.UUID, control: ControlKind, reason: str,
                  interrupt_generation: int, tenant_id: int | None, collect_request_id: uuid.UUID | None = None,
                  replacement_task_id: uuid.UUID | None = None, urgent: bool = False,
                  now: datetime | None = None) -> OutboxEvent:
    """The outbox event of one task_control (for a caller that writes a batch of events with `enqueue_many`)."""
    message = TaskControl(kind="monitor", task_id=task_id, target_client_id=client_id, control=control, reason=reason,
                          interrupt_generation=interrupt_generation, updated_at=now or datetime.now(UTC),
                          collect_request_id=collect_request_id, replacement_task_id=replacement_task_id)
    return OutboxEvent(exchange=DISPATCH, routing_key=f"monitor.control.{client_id}", message=message,
                       ordering_key=f"client:{client_id}", tenant_id=tenant_id, priority=URGENT if urgent else 0)


async def send_control(conn: Conn, *, task_id: uuid.UUID, client_id: uuid.UUID, control: ControlKind, reason: str,
                       interrupt_generation: int, tenant_id: int | None, collect_request_id: uuid.UUID | None = None,
                       replacement_task_id: uuid.UUID | None = None, urgent: bool = False,
                       notify: bool = False) -> None:
    """One task_control through the outbox, in the caller's transaction (`notify`: wake the pumps at commit)."""
    event = control_event(task_id=task_id, client_id=client_id, control=control, reason=reason,
                          interrupt_generation=interrupt_generation, tenant_id=tenant_id,
                          collect_request_id=collect_request_id, replacement_task_id=replacement_task_id,
                          urgent=urgent)
    await enqueue_many(conn, [event], notify=notify)
