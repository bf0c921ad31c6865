"""bench.py's read floor (tools/read_floor.py) reads every vector of its buffer exactly once, in every
configuration, including its last round, whose loads past the end are predicated off: the kernel's
check build XORs every word it read into one result, which must equal the host's XOR of the buffer (a
vector read twice cancels out, one never read is missing). The timed build stores nothing for a zero
buffer and stores its "never" value when the buffer's XOR is that value (its loads are live)."""

import os
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools"))
import read_floor  # noqa: E402

pytestmark = pytest.mark.gpu

# 96 MiB plus 48 bytes: several full rounds for the smaller grids, and a partial last round for every
# configuration (the largest round, 132 SMs x 16 CTAs x 512 threads x 8 x 16 bytes, is 138 MiB)
NBYTES = 96 * 1024 * 1024 + 48


@pytest.fixture(scope="module")
def random_buffer():
    g = torch.Generator().manual_seed(5)
    host = torch.randint(-(2**31), 2**31 - 1, (NBYTES // 4,), generator=g, dtype=torch.int32)
    return host.view(torch.uint8).cuda(), int(np.bitwise_xor.reduce(host.numpy()))


@pytest.mark.parametrize("cps,threads,width,unroll", read_floor.configs())
def test_every_vector_is_read_exactly_once(cps, threads, width, unroll, random_buffer):
    buf, xor = random_buffer
    run = read_floor.reader(buf, threads, width, cps, unroll, check=True)
    run()
    torch.cuda.synchronize()
    assert run.out.item() == xor


def test_timed_build_stores_only_the_never_value():
    buf = torch.zeros(NBYTES, dtype=torch.uint8, device="cuda")
    run = read_floor.reader(buf, 256, 16, 16, out_init=0x5A5A)
    run()
    torch.cuda.synchronize()
    assert run.out.item() == 0x5A5A
    buf.view(torch.int32)[-1] = read_floor.NEVER  # in the tail
    run()
    torch.cuda.synchronize()
    assert run.out.item() == read_floor.NEVER
