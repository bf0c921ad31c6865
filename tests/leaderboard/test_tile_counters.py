"""Where the dynamic bulk kernel's tile counters live (``tile_counters``), on the CPU with the allocation
stubbed: one set a device and stream (a thread, too, for the per-thread default stream), none inside a
graph capture, one allocation when threads race to the first call, and a replaced set kept alive."""

import threading

import pytest
import torch

import submission


@pytest.fixture
def made(monkeypatch):
    """Counters on the CPU, every allocation recorded."""
    made = []

    def new(dev, n):
        made.append((dev, n))
        return torch.zeros(n, dtype=torch.int32)

    monkeypatch.setattr(submission, "_new_counters", new)
    monkeypatch.setattr(submission, "_capturing", lambda: False)
    monkeypatch.setattr(submission, "_counters", {})
    monkeypatch.setattr(submission, "_counters_kept", [])
    return made


def test_one_set_a_device_and_stream(made):
    first = submission.tile_counters(0, 1234, 8)
    assert submission.tile_counters(0, 1234, 8) == first and submission.tile_counters(0, 1234, 3) == first
    others = {submission.tile_counters(0, 5678, 8), submission.tile_counters(1, 1234, 8)}
    assert first not in others and len(others) == 2 and len(made) == 3


def test_a_graph_capture_gets_no_counters(made, monkeypatch):
    monkeypatch.setattr(submission, "_capturing", lambda: True)
    assert submission.tile_counters(0, 1234, 8) == 0 and made == []


def test_more_batch_indices_get_a_larger_set_and_the_old_one_stays_alive(made):
    small = submission.tile_counters(0, 1234, 8)
    old = submission._counters[(0, 1234)][2]
    large = submission.tile_counters(0, 1234, 200)
    assert large != small and made == [(0, 64), (0, 256)]
    assert submission._counters_kept == [old] and old.data_ptr() == small


class Watched(dict):
    """The counters' dict, which sets ``all_in`` once ``n`` threads have looked up a set."""

    def __init__(self, n):
        super().__init__()
        self.n, self.seen, self.all_in = n, set(), threading.Event()

    def get(self, key, default=None):
        self.seen.add(threading.get_ident())
        if len(self.seen) >= self.n:
            self.all_in.set()
        return super().get(key, default)


def test_threads_racing_to_the_first_call_share_one_set(made, monkeypatch):
    """Every thread has looked (and found nothing) before the first allocation ends: only a second look
    under the lock keeps the others from allocating sets of their own."""
    watched = Watched(8)
    monkeypatch.setattr(submission, "_counters", watched)
    new = submission._new_counters

    def slow(dev, n):
        watched.all_in.wait(10)
        return new(dev, n)

    monkeypatch.setattr(submission, "_new_counters", slow)
    got = []
    threads = [threading.Thread(target=lambda: got.append(submission.tile_counters(0, 1234, 4))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert watched.all_in.is_set() and len(got) == 8
    assert len(set(got)) == 1 and len(made) == 1


def test_the_per_thread_default_stream_gets_a_set_a_thread(made):
    """One thread after the other: a thread's launches may outlive it, so a new thread gets a new set even
    where it reuses the ended thread's id."""
    got = []
    threads = [threading.Thread(target=lambda: got.append(submission.tile_counters(0, 2, 4))) for _ in range(2)]
    for t in threads:
        t.start()
        t.join()
    assert len(set(got)) == 2


def test_the_claim_address_trick_needs_the_tables_top_bits_clear():
    """The kernel adds ``tbl >> 30`` (0, but opaque to ptxas) to the counter's address."""
    assert submission.E2M1_TIMES2_LO >> 30 == 0
