"""A faithful simulated desktop client (docs/architecture.md §14): one serial scheduler loop per client, WebSocket
push + pull-lease, execution phases with safe points, generation checks. Library + `desktop-sim` CLI."""

from tools.desktop_sim.client import SimClient, SimOptions, SimStats
from tools.desktop_sim.timings import TIMING_PROFILES, TimingProfile

__all__ = ["TIMING_PROFILES", "SimClient", "SimOptions", "SimStats", "TimingProfile"]
