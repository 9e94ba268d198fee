"""Pure decision logic over plain values: no I/O here."""
