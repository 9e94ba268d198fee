"""Transactional outbox: write in the caller's transaction, publish with confirms from a pump (or, for a
latency-critical writer, from the writer itself right after its commit: relay.claim_own)."""

from libs.outbox.writer import NOTIFY_CHANNEL, OutboxEvent, enqueue, enqueue_many

__all__ = ["NOTIFY_CHANNEL", "OutboxEvent", "enqueue", "enqueue_many"]
