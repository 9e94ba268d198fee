from __future__ import annotations

from libs.ingest.write_rate import WriteSample, rows_per_second


def test_rate_is_the_counter_delta_over_the_seconds_between_samples() -> None:
    assert rows_per_second(WriteSample(10.0, 1_000), WriteSample(12.0, 7_000)) == 3_000


def test_no_rate_without_an_earlier_sample_or_across_a_statistics_reset() -> None:
    assert rows_per_second(None, WriteSample(1.0, 5)) is None
    assert rows_per_second(WriteSample(1.0, 500), WriteSample(2.0, 20)) is None  # pg_stat_reset()
    assert rows_per_second(WriteSample(2.0, 5), WriteSample(2.0, 9)) is None
