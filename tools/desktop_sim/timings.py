"""Per-platform phase durations. `fast` keeps tests quick; `demo` looks like real browser automation."""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

from tools.desktop_sim.rules import PHASES

_FAST = {"PREPARING": 0.02, "NAVIGATING": 0.03, "AUTHENTICATING": 0.02, "INPUTTING": 0.02, "SUBMITTING": 0.02,
         "WAITING": 0.10, "PARSING": 0.03, "POSTING": 0.0}
_DEMO_BASE = {"PREPARING": 0.6, "NAVIGATING": 1.8, "AUTHENTICATING": 1.0, "INPUTTING": 1.2, "SUBMITTING": 0.5,
              "WAITING": 7.0, "PARSING": 1.2, "POSTING": 0.0}
# docs/architecture.md §10.5: platforms answer at different speeds (OpenAI quick, Gemini slower, Perplexity slowest).
_DEMO_WAITING = {"openai": 7.0, "gemini": 12.0, "perplexity": 16.0}


@dataclass(frozen=True, slots=True)
class TimingProfile:
    name: str
    default: dict[str, float]
    per_platform: dict[str, dict[str, float]] = field(default_factory=dict)
    scale: float = 1.0
    # Each phase takes its duration times a uniform factor in [1 - jitter, 1 + jitter] (given a random source):
    # pages load and platforms answer at varying speeds, so a fleet that started together does not finish its
    # tasks in lockstep. 0 keeps every duration exact (tests).
    jitter: float = 0.0

    def duration(self, platform: str, phase: str, rng: random.Random | None = None) -> float:
        table = self.per_platform.get(platform, self.default)
        base = max(0.0, table.get(phase, self.default.get(phase, 0.0)) * self.scale)
        if rng is None or self.jitter <= 0:
            return base
        return base * rng.uniform(1.0 - self.jitter, 1.0 + self.jitter)

    def total(self, platform: str) -> float:
        """The expected duration of a task (every phase at its base duration)."""
        return sum(self.duration(platform, p) for p in PHASES)

    def scaled(self, factor: float) -> TimingProfile:
        return replace(self, scale=self.scale * factor)

    def with_jitter(self, jitter: float) -> TimingProfile:
        if not 0.0 <= jitter < 1.0:
            raise ValueError(f"jitter must be in [0, 1), got {jitter}")
        return replace(self, jitter=jitter)


TIMING_PROFILES: dict[str, TimingProfile] = {
    "fast": TimingProfile("fast", _FAST),
    "demo": TimingProfile("demo", _DEMO_BASE,
                          {code: {**_DEMO_BASE, "WAITING": wait} for code, wait in _DEMO_WAITING.items()}, jitter=0.3),
}
