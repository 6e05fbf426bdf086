"""``python -m bench`` without a GPU: one line that says what to do, and a CPU dry run whose
tables hold no verdict on GPU targets and no negative figure."""
from __future__ import annotations

import copy
import json
import re
import subprocess
import sys

import pytest

from bench import main, report
from tests.fake_cupy import NO_DEVICE, NOT_INSTALLED, ROOT, fake_cupy_env

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


def _bench(tmp_path, *args, timeout=120):
    return subprocess.run([sys.executable, "-m", "bench", *args], capture_output=True, text=True,
                          env=fake_cupy_env(tmp_path, NOT_INSTALLED), cwd=ROOT, timeout=timeout)


@pytest.mark.parametrize("pattern", ["[", "(", "decode b4|*"])
def test_a_bad_only_pattern_is_one_line_before_any_run(tmp_path, pattern):
    out = _bench(tmp_path, "--quick", "--device", "cpu", "--only", pattern, "--json", str(tmp_path / "b.json"))
    assert out.returncode == 2 and out.stdout == "" and "Traceback" not in out.stderr, out.stderr
    first, *rest = out.stderr.splitlines()
    assert first.startswith(f"kvcanary: bench: --only {pattern!r}: not a regular expression") and "expected" in first
    assert rest and rest[0].startswith("usage: python -m bench")
    assert "[bench]" not in out.stderr and not (tmp_path / "b.json").exists()


def test_an_unknown_argument_is_one_line_then_usage(tmp_path):
    out = _bench(tmp_path, "--device", "cpu", "--bogus")
    assert out.returncode == 2 and out.stdout == "", out.stderr
    first, *rest = out.stderr.splitlines()
    assert first == "kvcanary: bench: unrecognized arguments: --bogus" and rest[0].startswith("usage: python -m bench")


def test_the_cpu_dry_run_of_the_full_suite_is_sized_for_a_cpu(tmp_path):
    """Every case of the full suite, scaled down: small pools, the copy and gather probes
    small too, so even a run of one case is seconds, not the H200 sizes' hours."""
    j = tmp_path / "b.json"
    out = _bench(tmp_path, "--device", "cpu", "--no-baseline", "--runs", "1", "--only", r"^decode b256 ",
                 "--json", str(j), timeout=90)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(j.read_text())
    assert res["meta"]["suite"] == "full-cpu" and res["meta"]["elapsed_s"] < 60
    assert res["copy"]["buffer_bytes"] <= 64 << 20
    assert all(g["pool_slots"] <= 1 << 20 for g in res["gather"])
    (case,) = res["cases"]
    assert case["name"] == f"decode b{case['batch']} p{case['prefix']}"  # the name gives the sizes run
    assert case["entries"] <= 1 << 16  # scaled from the full suite's decode b4096 p4096 (16Mi entries)
    assert case["pool_slots"] <= 1 << 20 and not case["error"]
    assert any("CPU dry run" in n for n in res["meta"]["notes"])


def test_cpu_sizing_keeps_every_case_and_fits_the_memory_it_is_given():
    from bench import cases as C  # noqa: PLC0415
    from bench.runner import cpu_peak_bytes, cpu_sized  # noqa: PLC0415

    full = C.full_suite()
    largest = {}
    for memory in (24 << 30, 2 << 30, 400 << 20):
        s = cpu_sized(full, memory_bytes=memory)
        largest[memory] = max(c.entries for c in s.cases)
        assert len(s.cases) == len(full.cases) and len({c.name for c in s.cases}) == len(s.cases)
        assert [(c.group, c.chain, c.mode, c.pool, c.ops) for c in s.cases] == \
            [(c.group, c.chain, c.mode, c.pool, c.ops) for c in full.cases]
        assert cpu_peak_bytes(s) <= memory / 4, memory
        assert s.hard_deadline_s <= 120 and s.runs <= 5
        hosts = [c for c in s.cases if c.group == "monitor" and c.mode == "NONE" and c.batch == s.monitor_host_batch]
        assert hosts  # the monitor's host figures still have their case
    assert largest[400 << 20] < largest[2 << 30] <= 1 << 16  # less memory, smaller cases
    small = cpu_sized(full, memory_bytes=1 << 20)  # too little for any size: the smallest, still every case
    assert len({c.name for c in small.cases}) == len(full.cases)
    assert C.full_suite() == full and full.cases[0].name == "decode b1 p512"  # the GPU sizes stay
