"""Transactional outbox: write in the caller's transaction, publish with confirms from a pump."""

from libs.outbox.writer import NOTIFY_CHANNEL, enqueue

__all__ = ["NOTIFY_CHANNEL", "enqueue"]
