"""Shared code of the control plane's services."""

# Installs the logger class that keeps `extra=` fields from ever crashing a call site; imported
# here so every `logging.getLogger` in libs/, services/ and tools/ gets it.
from libs.telemetry import logging as _structured_logging  # noqa: F401
