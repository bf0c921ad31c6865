"""tools/mutants.py stays in step with the code: every mutant's text is found exactly once (the mutants
themselves run in CI through .ci/run, and on the GPU machine with --gpu)."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools"))

import mutants  # noqa: E402


def test_every_mutant_applies_to_the_current_code():
    assert mutants.stale_mutants() == []
    assert len(mutants.MUTANTS) >= 20 and len({m[0] for m in mutants.MUTANTS}) == len(mutants.MUTANTS)
