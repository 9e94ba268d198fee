"""dispatch-hub: the desktop gateway (WebSocket push, desktop HTTP lease/extend/cancel/result)."""
