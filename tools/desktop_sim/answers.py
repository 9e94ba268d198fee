"""Plausible AI answers with citations, so ingest and projections have realistic data to chew on."""

from __future__ import annotations

import random
from dataclasses import dataclass

_SOURCES = (
    ("https://www.g2.com/categories/{slug}", "Best {topic} software — G2"),
    ("https://www.capterra.com/{slug}-software/", "{topic} software reviews — Capterra"),
    ("https://www.techradar.com/best/{slug}", "The best {topic} in 2025 — TechRadar"),
    ("https://www.reddit.com/r/smallbusiness/comments/{slug}", "What {topic} do you use? : r/smallbusiness"),
    ("https://www.forbes.com/advisor/business/software/best-{slug}/", "Best {topic} of 2025 — Forbes Advisor"),
    ("https://en.wikipedia.org/wiki/{slug}", "{topic} — Wikipedia"),
    ("https://www.pcmag.com/picks/the-best-{slug}", "The Best {topic} for 2025 — PCMag"),
)
_COMPETITORS = ("Northwind", "Contoso", "Globex", "Initech", "Umbrella", "Stark Tools", "Wayne Systems")


@dataclass(frozen=True, slots=True)
class Answer:
    text: str
    citations: list[dict[str, object]]
    brand_mentioned: bool


def compose_answer(*, question: str, brand: str, platform: str, rng: random.Random, mention_rate: float) -> Answer:
    mentioned = rng.random() < mention_rate
    topic = question.rstrip("?").split(" for ")[0].split(" the ")[-1][:40] or "tools"
    slug = "-".join(topic.lower().split())[:40] or "tools"
    picks = rng.sample(_COMPETITORS, 3)
    if mentioned:
        picks.insert(rng.randrange(len(picks) + 1), brand)
    lines = [f"Here is an overview based on current reviews ({platform}):"]
    for rank, name in enumerate(picks, start=1):
        lines.append(f"{rank}. {name} — well regarded for ease of use and support; pricing varies by plan.")
    lines.append("Consider your team size, integrations and budget before choosing.")
    sources = rng.sample(_SOURCES, rng.randint(1, 4))
    citations: list[dict[str, object]] = [
        {"url": url.format(slug=slug), "title": title.format(topic=topic), "position": position}
        for position, (url, title) in enumerate(sources, start=1)]
    return Answer(text="\n".join(lines), citations=citations, brand_mentioned=mentioned)
