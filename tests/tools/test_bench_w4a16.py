"""tools/bench_w4a16.py's sweep barrier (CPU): a process times only once every process of its sweep has
compiled, and a sweep whose peers never arrive fails instead of hanging."""

import os
import sys
import threading
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools"))
import bench_w4a16  # noqa: E402


def test_the_barrier_waits_for_every_process_of_the_sweep(tmp_path):
    folder = str(tmp_path / "lock.ready")

    def late_peer():
        time.sleep(1.0)
        os.makedirs(folder, exist_ok=True)
        open(os.path.join(folder, "peer"), "w").close()

    peer = threading.Thread(target=late_peer)
    t0 = time.time()
    peer.start()
    bench_w4a16.wait_for_peers(folder, 2, timeout_s=30)
    waited = time.time() - t0  # before the join, which alone would take the peer's second
    peer.join()
    assert waited >= 0.9
    assert sorted(os.listdir(folder)) == sorted(["peer", str(os.getpid())])


def test_the_barrier_fails_when_peers_never_compile(tmp_path):
    with pytest.raises(RuntimeError, match="1 of 2 processes compiled"):
        bench_w4a16.wait_for_peers(str(tmp_path / "lock.ready"), 2, timeout_s=1)
