"""Writes submission.py, the one file the leaderboard takes, from the package's kernel module.

``nvfp4_gemv/kernel.py`` is the source (it imports only torch and cutlass); ``submission.py`` is the same
code with the competition's ``task`` types imported. ``--check`` exits 1 where the file on disk differs
(CI runs it through tests/test_packaging.py).

Usage: python tools/gen_submission.py [--check]
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE = os.path.join(ROOT, "nvfp4_gemv", "kernel.py")
TARGET = os.path.join(ROOT, "submission.py")
HEADER = "# Generated from nvfp4_gemv/kernel.py by tools/gen_submission.py: edit that file, then run the tool.\n"
TYPES_LINE = ("input_t = output_t = tuple  # submission.py: the competition's own types, from task "
              "(tools/gen_submission.py)\n")


def render():
    with open(SOURCE) as f:
        text = f.read()
    if text.count(TYPES_LINE) != 1:
        raise SystemExit(f"{SOURCE}: expected the types line once:\n{TYPES_LINE}")
    return HEADER + text.replace(TYPES_LINE, "from task import input_t, output_t\n")


def main(argv):
    text = render()
    if "--check" in argv:
        with open(TARGET) as f:
            if f.read() != text:
                print("submission.py is out of date: run python tools/gen_submission.py", file=sys.stderr)
                return 1
        return 0
    with open(TARGET, "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
