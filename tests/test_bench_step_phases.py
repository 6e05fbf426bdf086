"""``python -m bench.step_phases`` on a machine without a GPU: its kernel variants are made and
compile, each leaves out more than the one before, and its report takes their differences."""
from __future__ import annotations

import pytest

from bench import step_phases
from kvcanary_cupy.backends import cuda_sources
from tests.nvrtc import compile_cubin


@pytest.fixture
def variants(tmp_path):
    return step_phases.build_variants(cuda_sources.kernels_dir(), tmp_path)


def _step_source(folder, monkeypatch) -> str:
    monkeypatch.setenv(cuda_sources.ENV_DIR, str(folder))
    cuda_sources.source.cache_clear()
    try:
        return cuda_sources.source("step")
    finally:
        monkeypatch.delenv(cuda_sources.ENV_DIR)
        cuda_sources.source.cache_clear()


def test_variants_cut_more_one_after_another(variants, monkeypatch):
    assert list(variants) == step_phases.VARIANTS
    texts = [_step_source(variants[v], monkeypatch) for v in step_phases.VARIANTS]
    assert texts[0] == cuda_sources.source("step")  # "whole" is the library's own kernel
    whole = set(texts[0].splitlines())
    for before, after in zip(texts, texts[1:]):
        assert after != before
        assert set(before.splitlines()) - whole <= set(after.splitlines())  # the earlier cuts stay


@pytest.mark.parametrize("variant", step_phases.VARIANTS)
def test_every_variant_compiles(variants, variant, monkeypatch):
    spec = cuda_sources.MODULES["step"]
    compile_cubin(_step_source(variants[variant], monkeypatch), spec.file, spec.options, spec.name_expressions,
                  "sm_90")


def test_report_gives_each_phase_as_a_difference():
    figures = {v: 10.0 - i for i, v in enumerate(step_phases.VARIANTS)}  # each cut takes 1 us off
    results = {v: [{"1/flushed": t, "1/warm": t / 2, "violations": 0}] for v, t in figures.items()}
    text = step_phases.report(results, [1])
    phases = [line for line in text.splitlines() for v in step_phases.VARIANTS[1:] if f"({v}) |" in line]
    assert len(phases) == len(step_phases.VARIANTS)  # each cut, and the empty launch itself
    for line in phases:
        expected = [" 4.00 ", " 2.00 "] if line.startswith("| the launch") else [" 1.00 ", " 0.50 "]
        assert line.split("|")[2:4] == expected, line


def test_code_report_takes_the_fetch_as_flushed_minus_code_in_l2():
    rounds = [{"1/flushed": f, "1/code in L2": c, "1/warm": w, "64/flushed": 27.0, "64/code in L2": 25.5,
               "64/warm": 21.0, "violations": 0} for f, c, w in ((16.0, 13.5, 11.5), (17.0, 13.9, 11.7),
                                                                  (16.4, 13.6, 11.6))]
    rows = [line.split("|")[1:-1] for line in step_phases.report_code(rounds, [1, 64]).splitlines()
            if line.startswith("| 1 ") or line.startswith("| 64 ")]
    assert [[c.strip() for c in r] for r in rows] == [["1", "16.40", "13.60", "11.60", "2.80"],
                                                      ["64", "27.00", "25.50", "21.00", "1.50"]]


@pytest.mark.parametrize("argv,named", [(["--batches", "0,64"], "--batches"), (["--batches", "512"], "--batches"),
                                        (["--batches", "a"], "--batches"), (["--runs", "0"], "--runs"),
                                        (["--rounds", "0"], "--rounds")])
def test_misuse_is_one_line_naming_the_argument(argv, named, capsys):
    assert step_phases.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"kvcanary: {named}: expected") and "\n" not in err
