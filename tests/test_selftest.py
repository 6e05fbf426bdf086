"""``python -m kvcanary_cupy selftest | info``: the report, the exit codes, the CLI."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvcanary_cupy import __main__ as cli
from kvcanary_cupy import selftest
from kvcanary_cupy.sim import FAULTS
from kvcanary_cupy.sim.faults import Fault, TableRepoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}


def test_small_run_passes_and_reports_every_class_for_both_chain_kinds():
    lines = []
    report = selftest.run(backend="numpy", steps=60, injections=2, seed=3, progress=lines.append)
    assert report["ok"] and report["backend"] == "numpy"
    assert list(report["chains"]) == ["scan", "sglang"]  # the default runs the campaign once per kind
    for kind, r in report["chains"].items():
        assert r["ok"] and r["seconds"] > 0, kind
        assert r["clean"]["steps"] == 60 and r["clean"]["violations"] == 0
        assert [c["number"] for c in r["classes"]] == [f.number for f in FAULTS]
        for c in r["classes"]:
            assert (c["injected"], c["detected"], c["false_positives"]) == (2, 2, 0)
            assert c["median_steps"] is not None and 0 <= c["median_steps"] <= selftest.WAIT_STEPS
    assert any("clean run" in s for s in lines) and sum("/10]" in s for s in lines) == 2 * len(FAULTS)
    assert "chain kinds scan, sglang" in lines[0] and "per chain kind" in lines[0]
    table = selftest.format_table(report)
    assert "chain 'scan': PASS" in table and "chain 'sglang': PASS" in table
    assert table.splitlines()[-1].startswith("PASS (chain kinds: scan, sglang)")
    assert "median steps" in table and "false pos." in table
    for f in FAULTS:
        assert table.count(f.name) == 2


def test_one_chain_kind_runs_alone():
    report = selftest.run(backend="numpy", steps=20, injections=1, chain="sglang", progress=lambda s: None)
    assert report["ok"] and list(report["chains"]) == ["sglang"]
    with pytest.raises(ValueError, match="^kvcanary: chain"):
        selftest.run(backend="numpy", steps=20, injections=1, chain="v2", progress=lambda s: None)


class CaughtOnlyWithTheScanChain(TableRepoint):
    """A real fault under the scan chain; under the sglang chain it claims a fault that changes nothing."""

    number, name = 97, "caught only with the scan chain"

    def arm(self, sim) -> bool:
        if sim.cfg.chain == "scan":
            return super().arm(sim)
        self._fire(sim, at_next=True)
        return True


class NeverFires(Fault):
    number, name, detector = 99, "never fires", "none"

    def arm(self, sim) -> bool:
        return False


class NeverCaught(Fault):
    number, name, detector = 98, "caught by nothing", "none"

    def arm(self, sim) -> bool:
        self._fire(sim, at_next=True)  # claims a fault that changes nothing
        return True


def test_a_missed_or_uninjected_class_fails(monkeypatch, capsys):
    monkeypatch.setattr(selftest, "FAULTS", [NeverFires, NeverCaught])
    monkeypatch.setattr(selftest, "ARM_STEPS", 3)
    report = selftest.run(backend="numpy", steps=10, injections=2, progress=lambda s: None)
    never, missed = report["chains"]["scan"]["classes"]
    assert not report["ok"] and not report["chains"]["scan"]["ok"] and not report["chains"]["sglang"]["ok"]
    assert (never["injected"], never["detected"]) == (0, 0)
    assert (missed["injected"], missed["detected"], missed["false_positives"]) == (2, 0, 0)
    assert len(missed["misses"]) == 2
    assert selftest.main(["--backend", "numpy", "--steps", "10", "--injections", "1", "--quiet"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_the_run_fails_when_one_chain_kind_fails(monkeypatch, capsys):
    monkeypatch.setattr(selftest, "FAULTS", [CaughtOnlyWithTheScanChain])
    report = selftest.run(backend="numpy", steps=10, injections=2, progress=lambda s: None)
    assert report["chains"]["scan"]["ok"] and not report["chains"]["sglang"]["ok"] and not report["ok"]
    assert selftest.main(["--backend", "numpy", "--steps", "10", "--injections", "1", "--quiet"]) == 1
    out = capsys.readouterr().out
    assert "chain 'scan': PASS" in out and "chain 'sglang': FAIL" in out and "missed (sglang)" in out
    assert "\nFAIL (chain kinds: scan, sglang)" in out
    assert selftest.main(["--backend", "numpy", "--steps", "10", "--injections", "1", "--quiet",
                          "--chain", "scan"]) == 0


def test_main_writes_json(tmp_path, capsys):
    path = tmp_path / "report.json"
    rc = selftest.main(["--backend", "numpy", "--steps", "30", "--injections", "1", "--json", str(path), "--quiet"])
    assert rc == 0
    report = json.loads(path.read_text())
    assert report["ok"] and list(report["chains"]) == ["scan", "sglang"] and report["seconds"] > 0
    assert all(len(r["classes"]) == len(FAULTS) for r in report["chains"].values())
    assert "PASS" in capsys.readouterr().out
    rc = selftest.main(["--backend", "numpy", "--steps", "10", "--injections", "1", "--json", str(path), "--quiet",
                        "--chain", "sglang"])
    assert rc == 0 and list(json.loads(path.read_text())["chains"]) == ["sglang"]
    with pytest.raises(SystemExit) as e:
        selftest.main(["--chain", "v2"])
    assert e.value.code == 2 and "--chain" in capsys.readouterr().err


def fake_cupy(device_count):
    """A stand-in ``cupy`` module whose runtime reports ``device_count`` devices, or raises it."""
    import types  # noqa: PLC0415

    def count():
        if isinstance(device_count, BaseException):
            raise device_count
        return device_count

    mod = types.ModuleType("cupy")
    mod.__version__ = "14.0.0"
    mod.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceCount=count))
    return mod


def test_every_fault_class_is_caught_on_the_numba_backend():
    pytest.importorskip("numba")
    import kvcanary_cupy as kc

    before = kc.cpu_backend()
    lines = []
    report = selftest.run(backend="numba", steps=200, injections=3, seed=5, progress=lines.append)
    assert report["ok"] and report["backend"] == "numba" and report["device"] == "cpu"
    assert "on the numba backend (cpu)" in lines[0]
    for kind, r in report["chains"].items():
        assert r["clean"]["steps"] == 200 and r["clean"]["violations"] == 0, kind
        assert all((c["injected"], c["detected"], c["false_positives"]) == (3, 3, 0) for c in r["classes"]), kind
    assert kc.cpu_backend() == before  # the run's choice ends with it


def test_resolve_backend(monkeypatch):
    assert selftest.resolve_backend("numpy") == "cpu"
    assert selftest.resolve_backend("numba") == "cpu"
    assert selftest.resolve_backend("cuda") == "cuda"
    with pytest.raises(ValueError, match="kvcanary: backend"):
        selftest.resolve_backend("tpu")
    monkeypatch.setitem(sys.modules, "cupy", None)  # CuPy not installed
    assert selftest.resolve_backend("auto") == "cpu"
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy(RuntimeError("cudaErrorNoDevice")))  # no driver / device
    assert selftest.resolve_backend("auto") == "cpu"
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy(0))
    assert selftest.resolve_backend("auto") == "cpu"
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy(2))  # CuPy sees devices: auto picks CUDA
    assert selftest.resolve_backend("auto") == "cuda"


def test_cli_commands(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "kvcanary_cupy" in out and "kernel sources" in out and "gpu" in out
    assert cli.main([]) == 2 and "usage" in capsys.readouterr().out
    assert cli.main(["--help"]) == 0
    assert cli.main(["frobnicate"]) == 2 and "unknown command" in capsys.readouterr().err


def test_bench_is_not_in_the_package_and_says_where_it_is(capsys):
    """The benchmarks live in the checkout's bench/ folder: the package's ``bench`` command
    says so in one line and exits 2, whatever its arguments."""
    for argv in (["bench"], ["bench", "--quick", "--device", "cpu"]):
        assert cli.main(argv) == 2
        captured = capsys.readouterr()
        lines = captured.err.strip().splitlines()
        assert captured.out == "" and len(lines) == 1, captured
        assert "bench/" in lines[0] and "python -m bench" in lines[0], lines[0]
    out = subprocess.run([sys.executable, "-m", "kvcanary_cupy", "bench"], capture_output=True, text=True, env=ENV,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 2 and out.stdout == "" and len(out.stderr.strip().splitlines()) == 1, out
    assert "bench" not in cli.USAGE.split("\n", 1)[0]  # the usage line lists no bench command


def test_module_entry_point_runs_a_selftest():
    out = subprocess.run([sys.executable, "-m", "kvcanary_cupy", "selftest", "--backend", "numpy", "--steps", "30",
                          "--injections", "1"], capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "PASS" in out.stdout and "clean run" in out.stderr


@pytest.mark.gpu
def test_selftest_on_cuda():
    report = selftest.run(backend="cuda", steps=100, injections=2, progress=lambda s: None)
    assert report["ok"] and report["backend"] == "cuda", selftest.format_table(report)
    assert list(report["chains"]) == ["scan", "sglang"]


@pytest.mark.slow
def test_default_selftest_meets_its_bar():
    """The shipped defaults: per chain kind (both) >= 2,000 clean steps, 20 injections per class, all
    caught, silent. How long it took is in the report and printed by the CLI, not asserted here:
    a wall-clock bound fails on a loaded machine."""
    report = selftest.run(backend="numpy", progress=lambda s: None)
    assert report["ok"], selftest.format_table(report)
    assert list(report["chains"]) == ["scan", "sglang"]
    for r in report["chains"].values():
        assert r["clean"]["steps"] >= 2000 and r["clean"]["violations"] == 0
        assert all(c["injected"] == c["detected"] == 20 for c in r["classes"])
