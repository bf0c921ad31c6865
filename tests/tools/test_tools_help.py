"""Every script under tools/ (and bench.py, eval.py) answers ``--help`` with its usage and exit code 0, and
changes no file of the repository doing so (``gen_submission.py --help`` once rewrote submission.py)."""

import glob
import hashlib
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "tools", "*.py"))
                 if "__main__" in open(p).read()) + ["bench.py", "eval.py"]


def tree_digest():
    h = hashlib.sha256()
    for p in sorted(glob.glob(os.path.join(ROOT, "*.py")) + glob.glob(os.path.join(ROOT, "nvfp4_gemv", "*.py"))):
        with open(p, "rb") as f:  # contents and modification time: a rewrite of the same text counts too
            h.update(p.encode() + f.read() + str(os.stat(p).st_mtime_ns).encode())
    return h.hexdigest()


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_prints_usage_and_changes_nothing(script):
    before = tree_digest()
    r = subprocess.run([sys.executable, script, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip(), "no usage printed"
    assert tree_digest() == before
