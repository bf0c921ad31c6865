"""What installs, and the one file the leaderboard takes."""

import os
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import gen_submission  # noqa: E402


def test_submission_is_generated_from_the_package():
    with open(gen_submission.TARGET) as f:
        assert f.read() == gen_submission.render(), "run python tools/gen_submission.py"


def test_submission_imports_only_torch_cutlass_and_task():
    with open(gen_submission.TARGET) as f:
        tops = {line.split()[1].split(".")[0] for line in f if line.startswith(("import ", "from "))}
    assert tops <= {"ctypes", "dataclasses", "operator", "os", "struct", "threading", "typing", "warnings", "torch", "task",
                    "cutlass", "cuda"}, tops


def test_submission_is_the_leaderboard_entry_and_what_it_imports():
    """The stitched modules are those custom_kernel needs (not the op's), each once, dependencies first."""
    names = [os.path.basename(p)[:-3] for p in gen_submission.sources()]
    assert names[-1] == "leaderboard" and len(set(names)) == len(names)
    assert {"ptx", "decode", "streaming", "split", "bulk", "tuning", "launch"} <= set(names)
    assert not {"op", "reference", "tokens", "tokens_bulk", "mma"} & set(names)


def source_files():
    """The tracked files of a git checkout; outside one (an unpacked archive, tools/mutants.py's copies of
    the tree) every file under the root but caches, build outputs and dot-folders."""
    try:
        # untracked files too: a copy of the tree may carry an index older than its files
        proc = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                              capture_output=True, text=True)
        if proc.returncode == 0 and proc.stdout.strip():
            return proc.stdout.split()
    except FileNotFoundError:  # no git on this machine
        pass
    skip = {"__pycache__", "build", "dist", "out"}
    files = []
    for top, dirs, names in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in skip and not d.endswith(".egg-info")]
        files += [os.path.relpath(os.path.join(top, n), ROOT) for n in names if not n.endswith(".pyc")]
    return files


def test_wheel_installs_only_the_package(tmp_path):
    import importlib.util

    # builds offline where setuptools is installed (the GPU machine has no network)
    offline = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") else []
    src = tmp_path / "src"  # a copy: building in the checkout would leave build/ and egg-info behind
    files = source_files()
    if "pyproject.toml" not in files:
        pytest.skip("no source tree here (no pyproject.toml beside tests/): nothing to build a wheel from")
    for f in files:
        if not os.path.isfile(os.path.join(ROOT, f)):  # listed by a git index older than the tree (a copy)
            continue
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        (src / f).write_bytes(open(os.path.join(ROOT, f), "rb").read())
    out = tmp_path / "dist"
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", *offline, "-w", str(out), str(src)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = [p for p in os.listdir(out) if p.endswith(".whl")]
    with zipfile.ZipFile(out / wheel) as z:
        tops = {name.split("/")[0] for name in z.namelist()}
        names = set(z.namelist())
        (meta,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        metadata = z.read(meta).decode()
    assert {t for t in tops if not t.endswith(".dist-info")} == {"nvfp4_gemv"}, tops
    package = {os.path.relpath(os.path.join(d, f), ROOT).replace(os.sep, "/")
               for d, _, fs in os.walk(os.path.join(ROOT, "nvfp4_gemv")) for f in fs if f.endswith(".py")}
    assert {"nvfp4_gemv/leaderboard.py", "nvfp4_gemv/model/linear.py"} <= package and package <= names, package - names
    # the description is the README, and the licence is stated and shipped
    assert "License-Expression: MIT" in metadata and "Description-Content-Type: text/markdown" in metadata
    assert metadata.split("\n\n", 1)[1].startswith("# nvfp4-gemv")
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names


def test_the_stitcher_refuses_what_one_namespace_would_change(tmp_path, monkeypatch):
    """submission.py is one namespace: a package import it cannot replace, or a name two modules define,
    would change what a name means there; tools/gen_submission.py refuses both."""
    import pytest

    pkg = tmp_path / "nvfp4_gemv"
    pkg.mkdir()
    monkeypatch.setattr(gen_submission, "PACKAGE", str(pkg))
    (pkg / "helpers.py").write_text('"""Helpers."""\n\nimport os\n\nLIMIT = 4\n\n\ndef f():\n    return os.sep\n')

    def entry(body):
        (pkg / "leaderboard.py").write_text(f'"""The entry."""\n\nimport torch\n{gen_submission.TYPES_LINE}{body}')

    entry("from .helpers import LIMIT, f\n\n\ndef g():\n    return f(), LIMIT\n")
    text = gen_submission.render()
    assert text.index("def f():") < text.index("def g():") and "from .helpers" not in text
    assert "from task import input_t, output_t" in text and text.count('"""The entry."""') == 1
    for body, why in [("from .helpers import f\n\n\ndef f():\n    pass\n", "also defined"),
                      ("from .helpers import f as h\n", "only 'from .module import name"),
                      ("from . import helpers\n", "only 'from .module import name"),
                      ("from .helpers import missing\n", "not defined at the top"),
                      ("def g():\n    from .helpers import f\n", "inside a block"),
                      ("from os import sep as LIMIT\nfrom .helpers import f\n", "bound otherwise")]:
        entry(body)
        with pytest.raises(SystemExit, match=why):
            gen_submission.render()


def test_the_model_side_modules_keep_their_flat_names_for_imports_and_pickles():
    """``nvfp4_gemv.model`` holds the model side; ``nvfp4_gemv.linear`` and the others (imports and modules
    pickled before the sub-package) name the same module objects."""
    import importlib
    import pickle

    import nvfp4_gemv
    from nvfp4_gemv.model import MODULES

    for name in MODULES:
        assert importlib.import_module(f"nvfp4_gemv.{name}") is importlib.import_module(f"nvfp4_gemv.model.{name}")
        assert getattr(nvfp4_gemv, name) is importlib.import_module(f"nvfp4_gemv.model.{name}")
    assert pickle.loads(b"cnvfp4_gemv.linear\nNVFP4Linear\n.") is nvfp4_gemv.NVFP4Linear
    assert pickle.loads(b"cnvfp4_gemv.fuse\nSiblings\n.") is nvfp4_gemv.model.fuse.Siblings
    from nvfp4_gemv.experts import calibrate_expert_input_scales  # moved on to experts_convert: still here

    assert calibrate_expert_input_scales is nvfp4_gemv.calibrate_expert_input_scales
    listed = {f[:-3] for f in os.listdir(os.path.join(ROOT, "nvfp4_gemv", "model")) if f.endswith(".py")}
    assert listed - {"__init__"} == set(MODULES)
