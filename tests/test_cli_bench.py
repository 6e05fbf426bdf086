"""``python -m bench`` without a GPU: one line that says what to do, and a CPU dry run whose
tables hold no verdict on GPU targets and no negative figure."""
from __future__ import annotations

import copy
import re
import subprocess
import sys

import pytest

from bench import main, report
from tests.fake_cupy import NO_DEVICE, NOT_INSTALLED, fake_cupy_env

NEGATIVE = re.compile(r"(?<![\w.\-])-\d")  # a minus sign starting a figure


@pytest.mark.parametrize("source", [NO_DEVICE, NOT_INSTALLED], ids=["no-device", "not-installed"])
def test_bench_without_a_cuda_device_is_one_line_not_a_traceback(tmp_path, source):
    out = subprocess.run([sys.executable, "-m", "bench", "--json", str(tmp_path / "b.json")],
                         capture_output=True, text=True, env=fake_cupy_env(tmp_path, source), cwd=tmp_path,
                         timeout=300)
    assert out.returncode != 0
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert lines[0].startswith("kvcanary: bench: no CUDA device") and "--device cpu" in lines[0]
    assert out.stdout == "" and not (tmp_path / "b.json").exists()


def test_cpu_dry_run_gives_no_verdict_on_gpu_targets(tmp_path, capsys):
    rc = main(["--quick", "--device", "cpu", "--runs", "1", "--no-baseline", "--json", str(tmp_path / "b.json"),
               "--only", r"decode b4|write row 1x|monitor b2"])
    out = capsys.readouterr().out
    assert rc == 0
    table = out[out.index("copy bandwidth:"):].splitlines()[3:]  # the short table's rows, printed last
    assert table and all(row.rstrip().endswith("n/a (GPU target)") for row in table), table
    assert "PASS" not in out and "MISS" not in out
    assert "CPU dry run" in out
    assert not NEGATIVE.search(out), NEGATIVE.search(out)


def _write_rows(platform, all_us, none_us):
    """A made-up result with only the 16K-token row write (ALL and NONE) on ``platform``."""
    def row(mode, us):
        return {"name": f"write row 1x256B {mode}", "group": "write_row", "entries": 0, "tokens": 16384,
                "mode": mode, "kv_layers": 1, "pool_label": "1x256B", "timed_ops": ["write"], "error": None,
                "chain": "scan",
                "ops": {"write": {"device_us": us, "host_us": 5.0, "floor_us": 1.0, "x_floor": us}},
                "baseline": {"skipped": "n/a"}}

    return {"meta": {"platform": platform, "device": "x", "runs": 1}, "copy": {}, "host": {},
            "cases": [row("ALL", all_us), row("NONE", none_us)]}


def test_a_cpu_total_below_the_serial_chain_prints_no_negative_fingerprint_part():
    md = report.markdown(_write_rows("cpu", 40_000.0, 60_566.0))
    assert "| 1x256B | scan | 16Ki | 40,000 | 60,566 | n/a |" in md
    assert not NEGATIVE.search(md)
    md = report.markdown(_write_rows("cpu", 60_000.0, 40_000.0))
    assert "| 1x256B | scan | 16Ki | 60,000 | 40,000 | 20,000 |" in md


def test_gpu_results_keep_their_verdicts():
    r = _write_rows("cuda", 2_828.0, 2_724.0)
    r["host"] = {"bare_launch_us": 4.0, "plan_us": 5.0, "verify_us": 7.0, "write_us": 5.0, "step_us": 18.0}
    gpu = report.markdown(r)
    assert "GPU target" not in gpu and "CPU dry run" not in gpu
    assert "**PASS**" in gpu and "**MISS**" in gpu and "| 104.0 |" in gpu
    cpu = copy.deepcopy(r)
    cpu["meta"]["platform"] = "cpu"
    assert {t["result"] for t in report.evaluate(cpu)} == {"n/a"}
