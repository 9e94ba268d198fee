"""Benchmarks (`make bench`): each `bench/b_*.py` module exposes `async def run(args) -> None` and prints figures."""
