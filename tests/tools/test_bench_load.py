"""tools/bench_load.py on the CPU at a tiny size: it exports, reads and loads, and reports the loader's cost
over the read (the GPU machine runs it at Llama sizes)."""

import json
import os
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools"))
import bench_load  # noqa: E402


@pytest.mark.parametrize("extra", [[], ["--mode", "w4a4", "--fuse"], ["--pack", "--tie"], ["--loader", "from_pretrained"]])
def test_tiny_run_loads_and_reports_the_cost_over_the_read(tmp_path, extra, capsys):
    out = tmp_path / "r.json"
    r = bench_load.main(["--layers", "1", "--hidden", "128", "--intermediate", "256", "--heads", "4",
                         "--kv-heads", "2", "--vocab", "256", "--reps", "1", "--json", str(out), *extra])
    assert r["bytes"] > 0 and r["read_s"] > 0 and r["load_s"] > 0
    assert r["over_read_s"] == r["load_s"] - r["read_s"]
    assert json.loads(out.read_text())["args"]["mode"] == ("w4a4" if "w4a4" in extra else "w4a16")
    assert ("from_pretrained" if "from_pretrained" in extra else "load_modelopt") in capsys.readouterr().out


def test_generate_decodes_with_the_loaded_model_and_reports_its_time(tmp_path, capsys):
    r = bench_load.main(["--layers", "1", "--hidden", "128", "--intermediate", "256", "--heads", "4",
                         "--kv-heads", "2", "--vocab", "256", "--reps", "1", "--loader", "from_pretrained",
                         "--generate", "3"])
    assert r["decode_tokens"] == 3 and r["decode_ms_per_token"] > 0 and r["logits_finite"] is True
    assert "generate: 3 tokens" in capsys.readouterr().out


def test_negative_generate_is_refused_by_name():
    with pytest.raises(SystemExit):
        bench_load.main(["--generate", "-1"])
