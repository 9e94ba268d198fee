"""Transactional outbox: write in the caller's transaction, publish with confirms from a pump."""

from libs.outbox.writer import NOTIFY_CHANNEL, OutboxEvent, enqueue, enqueue_many

__all__ = ["NOTIFY_CHANNEL", "OutboxEvent", "enqueue", "enqueue_many"]
