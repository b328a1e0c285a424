"""wire/parts.py: a jax shard's index becomes the box the shard reads back."""

from __future__ import annotations

import numpy as np
import pytest

from atoll.server.intake import push_header
from atoll.server.parts import Box
from atoll.wire import syncer_pb2 as pb
from atoll.wire.parts import tensor_box


def test_a_shard_index_becomes_a_box_the_shard_reads_back():
    boxes = [tensor_box(0, (slice(None), slice(4, 8)), (16, 8)), tensor_box(2, None, (5,))]
    h = push_header(pb.PushHeader(learner_id="a", parts=2, part=1, boxes=boxes))
    assert h.boxes == (Box(0, (0, 4), (16, 8)), Box(2))
    leaf = np.arange(128).reshape(16, 8)
    assert h.boxes[0].view(leaf).tolist() == leaf[:, 4:8].tolist()


@pytest.mark.parametrize(
    "index", [(slice(None),), (slice(0, 16, 2), slice(None)), (slice(3, 3), slice(None))]
)
def test_an_index_that_is_no_box_is_refused(index):
    with pytest.raises(ValueError):
        tensor_box(0, index, (16, 8))
