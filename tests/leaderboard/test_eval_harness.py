"""eval.py: test-file parsing, seed mixing, and the runner's protocol, with small CPU submissions."""

import os
import subprocess
import sys

import pytest

import eval as harness

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SUBS = os.path.join(ROOT, "tests", "submissions")


def test_parse_valid_file():
    text = "m: 128; k: 256; l: 1; seed: 1111\n\nm: 256;k:512; l: 2; seed: 7; mode: fast\n"
    assert harness.parse_test_file(text) == [{"m": 128, "k": 256, "l": 1, "seed": 1111},
                                            {"m": 256, "k": 512, "l": 2, "seed": 7, "mode": "fast"}]


@pytest.mark.parametrize("text", ["m 128", "m: 12.5", "m: 1; : 3", "m: two words"])
def test_parse_invalid_file(text):
    with pytest.raises(harness.TestFileError):
        harness.parse_test_file(text)


def test_seed_mixing_is_cantor_pairing():
    assert harness.mix_seed(0, 0) == 0
    assert harness.mix_seed(1111, 3) == 1111 + 1114 * 1115 // 2
    assert len({harness.mix_seed(a, b) for a in range(20) for b in range(20)}) == 400


def run_protocol(tmp_path, mode, submission, cases="m: 128; k: 128; l: 2; seed: 5\n", env_extra=None):
    testfile = tmp_path / "cases.txt"
    testfile.write_text(cases)
    out = tmp_path / "out.txt"
    with open(out, "w") as f:
        env = dict(os.environ, POPCORN_FD=str(f.fileno()), **(env_extra or {}))
        proc = subprocess.run([sys.executable, os.path.join(ROOT, "eval.py"), mode, str(testfile),
                               "--submission", os.path.join(SUBS, submission)],
                              env=env, pass_fds=(f.fileno(),), capture_output=True, text=True, timeout=300)
    lines = dict(line.split(": ", 1) for line in out.read_text().splitlines())
    return proc.returncode, lines


def test_protocol_test_mode_pass(tmp_path):
    rc, lines = run_protocol(tmp_path, "test", "cpu_ok.py",
                             "m: 128; k: 128; l: 2; seed: 5\nm: 256; k: 64; l: 1; seed: 6\n")
    assert rc == 0
    assert lines["test-count"] == "2" and lines["check"] == "pass"
    assert lines["test.0.spec"] == "m: 128; k: 128; l: 2; seed: 5"
    assert lines["test.0.status"] == lines["test.1.status"] == "pass"


def test_protocol_benchmark_mode_reports_stats(tmp_path):
    rc, lines = run_protocol(tmp_path, "benchmark", "cpu_ok.py")
    assert rc == 0 and lines["benchmark-count"] == "1" and lines["check"] == "pass"
    runs = int(lines["benchmark.0.runs"])
    assert 2 < runs <= harness.BENCH_MAX_RUNS
    best, mean, worst = (float(lines[f"benchmark.0.{k}"]) for k in ("best", "mean", "worst"))
    assert 0 < best <= mean <= worst
    assert float(lines["benchmark.0.err"]) >= 0 and float(lines["benchmark.0.std"]) >= 0


def test_protocol_global_seed_is_mixed_in(tmp_path):
    _, lines = run_protocol(tmp_path, "test", "cpu_ok.py", env_extra={"POPCORN_SEED": "3"})
    assert lines["test.0.spec"] == f"m: 128; k: 128; l: 2; seed: {harness.mix_seed(5, 3)}"


def test_wrong_results_fail_with_112(tmp_path):
    rc, lines = run_protocol(tmp_path, "test", "wrong.py")
    assert rc == harness.EXIT_FAIL and lines["test.0.status"] == "fail" and lines["check"] == "fail"
    assert "mismatched elements" in lines["test.0.error"]


def test_raising_submission_is_a_failed_case(tmp_path):
    rc, lines = run_protocol(tmp_path, "benchmark", "raises.py")
    assert rc == harness.EXIT_FAIL and lines["benchmark.0.status"] == "fail"
    assert "boom from the submission" in lines["benchmark.0.error"]


def test_crashing_submission_is_a_failed_case(tmp_path):
    rc, lines = run_protocol(tmp_path, "test", "crashes.py")
    assert rc == harness.EXIT_FAIL and lines["test.0.status"] == "fail" and "died" in lines["test.0.error"]


def test_invalid_test_file_exits_113(tmp_path):
    (tmp_path / "bad.txt").write_text("m 128\n")
    env = dict(os.environ, POPCORN_FD="1")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "eval.py"), "test", str(tmp_path / "bad.txt")],
                          env=env, capture_output=True, text=True)
    assert proc.returncode == harness.EXIT_BAD_FILE and "invalid test file" in proc.stderr


def test_protocol_without_fd_exits_111_and_bad_args_exit_2():
    env = {k: v for k, v in os.environ.items() if k != "POPCORN_FD"}
    run = lambda *a: subprocess.run([sys.executable, os.path.join(ROOT, "eval.py"), *a], env=env,  # noqa: E731
                                    capture_output=True, text=True)
    assert run("test", "x.txt", "--protocol").returncode == harness.EXIT_NO_FD
    assert run("nonsense-mode").returncode == 2


def test_human_mode_on_cpu_prints_a_table(tmp_path):
    (tmp_path / "cases.txt").write_text("m: 128; k: 64; l: 1; seed: 2\n")
    env = {k: v for k, v in os.environ.items() if k != "POPCORN_FD"}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "eval.py"), "benchmark", str(tmp_path / "cases.txt"),
                           "--submission", os.path.join(SUBS, "cpu_ok.py"), "--json", str(tmp_path / "r.json")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "128x64x1" in proc.stdout and "median" in proc.stdout
    assert '"submission_sha256"' in (tmp_path / "r.json").read_text()


def _human(*args):
    env = {k: v for k, v in os.environ.items() if k != "POPCORN_FD"}
    return subprocess.run([sys.executable, os.path.join(ROOT, "eval.py"), *args], env=env, capture_output=True,
                          text=True, timeout=300)


def _skip_on_a_gpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("only meaningful without a GPU")


@pytest.mark.parametrize("mode", ["benchmark", "test"])
def test_our_submission_on_cpu_is_refused_at_once(mode):
    """`python eval.py` without CUDA: said before any case runs, with its own exit code (not a case's 112)."""
    _skip_on_a_gpu()
    proc = _human(mode)
    said = proc.stdout + proc.stderr
    assert proc.returncode == harness.EXIT_NO_CUDA, said
    assert said.count("needs a CUDA GPU") == 1 and "imports the CuTe DSL" in said, said
    assert "[1/" not in said and "runs there" not in said and "FAIL" not in said, said
    assert "python -m pytest" in said and "tests/submissions/cpu_ok.py" in said


def test_cuda_only_submission_on_cpu_says_a_gpu_is_needed(tmp_path):
    """A submission that needs CUDA but does not import the DSL is found out by its first case, once."""
    _skip_on_a_gpu()
    (tmp_path / "cases.txt").write_text("m: 128; k: 64; l: 1; seed: 2\nm: 256; k: 128; l: 1; seed: 3\n")
    proc = _human("test", str(tmp_path / "cases.txt"), "--submission", os.path.join(SUBS, "cuda_only.py"))
    assert proc.returncode == harness.EXIT_FAIL
    said = proc.stdout + proc.stderr
    # said once, then it stops: the second case would fail the same way
    assert said.count("needs a CUDA GPU") == 1 and said.count("expected a CUDA tensor") == 1, said
    assert "tests/submissions/cpu_ok.py" in said and "[2/2]" not in said


def test_the_cute_dsl_import_is_what_marks_a_gpu_only_submission(tmp_path):
    assert harness.imports_cute_dsl(os.path.join(ROOT, "submission.py"))
    for name in ("cpu_ok.py", "cuda_only.py", "raises.py"):
        assert not harness.imports_cute_dsl(os.path.join(SUBS, name)), name
    (tmp_path / "s.py").write_text("import torch\n# import cutlass, in a comment\nx = 'from cutlass import cute'\n")
    assert not harness.imports_cute_dsl(str(tmp_path / "s.py"))
    (tmp_path / "t.py").write_text("try:\n    from cutlass.cute import nvgpu\nexcept ImportError:\n    pass\n")
    assert harness.imports_cute_dsl(str(tmp_path / "t.py"))


def test_harness_runs_where_cute_dsl_is_missing(tmp_path):
    # a 'cutlass' that fails to import shadows the real one in the harness and in its workers
    (tmp_path / "shadow" / "cutlass").mkdir(parents=True)
    (tmp_path / "shadow" / "cutlass" / "__init__.py").write_text("raise ImportError('no CuTe DSL here')\n")
    testfile = tmp_path / "cases.txt"
    testfile.write_text("m: 128; k: 64; l: 1; seed: 3\n")
    out = tmp_path / "out.txt"
    with open(out, "w") as f:
        env = dict(os.environ, POPCORN_FD=str(f.fileno()),
                   PYTHONPATH=os.pathsep.join([str(tmp_path / "shadow"), os.environ.get("PYTHONPATH", "")]))
        proc = subprocess.run([sys.executable, os.path.join(ROOT, "eval.py"), "test", str(testfile),
                               "--submission", os.path.join(SUBS, "cpu_ok.py")],
                              env=env, pass_fds=(f.fileno(),), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "check: pass" in out.read_text()


def test_leaderboard_mode_checks_every_timed_run(tmp_path):
    """benchmark mode checks the first call only; leaderboard mode checks each run's fresh inputs."""
    rc, lines = run_protocol(tmp_path, "benchmark", "wrong_later.py")
    assert rc == 0 and lines["check"] == "pass"
    rc, lines = run_protocol(tmp_path, "leaderboard", "wrong_later.py")
    assert rc == harness.EXIT_FAIL and lines["check"] == "fail"
    assert lines["benchmark.0.status"] == "fail" and "seed" in lines["benchmark.0.error"]


def test_leaderboard_mode_passes_a_right_submission(tmp_path):
    rc, lines = run_protocol(tmp_path, "leaderboard", "cpu_ok.py")
    assert rc == 0 and lines["check"] == "pass" and int(lines["benchmark.0.runs"]) > 2


def test_profile_mode_reports_a_profiler_table(tmp_path):
    import base64

    rc, lines = run_protocol(tmp_path, "profile", "cpu_ok.py")
    assert rc == 0 and lines["check"] == "pass"
    report = base64.b64decode(lines["benchmark.0.report"]).decode()
    assert "Self CPU time total" in report


def test_a_time_faster_than_the_bandwidth_allows_is_suspect():
    nbytes = harness.bytes_moved({"m": 7168, "k": 16384, "l": 1})  # 66 MB: 15.1 us at 4.38 TB/s
    assert harness.is_suspect(10.0, nbytes, 4.38) and not harness.is_suspect(16.0, nbytes, 4.38)


def test_a_suspect_row_is_flagged_in_the_table(capsys):
    case = {"m": 7168, "k": 16384, "l": 1, "seed": 1}
    stats = {"median": 1.0, "p20": 1.0, "p80": 1.0, "mean": 1.0, "err": 0.0, "best": 1.0, "runs": 10}
    row = harness.Row(case, "pass", stats=stats, tbps=60.0, pct_of_ceiling=1500.0, sol_us=15.0, suspect=True)
    harness.print_table([row], "benchmark")
    out = capsys.readouterr().out
    assert "SUSPECT" in out and "% ceil" in out and "1500%" in out and "read floor" in out
