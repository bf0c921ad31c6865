"""bench.py's read floor (tools/read_floor.py) reads every vector of its buffer, in every configuration:
a buffer whose only non-zero word is the kernel's "never" value at a given place makes it store that
value; a zero buffer makes it store nothing."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
import read_floor  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("cps,threads,width", read_floor.configs())
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_every_vector_is_read(cps, threads, width, where):
    nbytes = 3 * 1024 * 1024 + 48  # not a multiple of a grid's worth of vectors: the tail loop runs
    buf = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    word = {"first": 0, "middle": nbytes // 8 + 5, "last": nbytes // 4 - 1}[where]
    buf.view(torch.int32)[word] = read_floor.NEVER
    run = read_floor.reader(buf, threads, width, cps)
    run()
    torch.cuda.synchronize()
    assert run.out.item() == read_floor.NEVER


def test_zero_buffer_stores_nothing():
    buf = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda")
    run = read_floor.reader(buf, 256, 16, 16)
    run()
    torch.cuda.synchronize()
    assert run.out.item() == 0
