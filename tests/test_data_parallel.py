"""The data-parallel baseline's settings, checked without starting anything; its gloo
processes are tried in tests/integration/test_data_parallel_gloo.py."""

from __future__ import annotations

import pytest

from atoll.bench import data_parallel as dp


def test_a_job_needs_one_process_per_shard():
    with pytest.raises(ValueError, match="3 processes for 2 shards"):
        dp.train(dp.DataParallelConfig(shards=2, steps=1), process_id=0, num_processes=3)
    with pytest.raises(ValueError, match="steps must be an int >= 1"):
        dp.DataParallelConfig(steps=0)
