"""``--help`` of every command documents every option, with a description that ends its sentence."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "COLUMNS": "100"}


def undocumented(help_text: str) -> list[str]:
    """The options of an argparse ``--help`` that have no help text."""
    lines = help_text.split("options:", 1)[1].splitlines()
    out = []
    for i, line in enumerate(lines):
        m = re.match(r"^  (-\S.*?)(?:\s{2,}(\S.*))?$", line)
        if not m or m.group(1).startswith("-h, --help"):
            continue
        follows = i + 1 < len(lines) and re.match(r"^\s{4,}\S", lines[i + 1]) and not re.match(r"^  -", lines[i + 1])
        if not (m.group(2) or follows):
            out.append(m.group(1).split()[0])
    return out


def description(help_text: str) -> str:
    """The description paragraph: between the usage block and the option list."""
    head = help_text.split("options:", 1)[0]
    paragraphs = [p for p in re.split(r"\n\s*\n", head) if p.strip()]
    assert len(paragraphs) >= 2, help_text
    return " ".join(paragraphs[1].split())


@pytest.mark.parametrize("command", [("kvcanary_cupy", "selftest"), ("kvcanary_cupy", "report"), ("bench",),
                                     ("bench.selfcheck",)],
                         ids=["selftest", "report", "bench", "bench.selfcheck"])
def test_help_documents_every_option(command):
    out = subprocess.run([sys.executable, "-m", *command, "--help"], capture_output=True, text=True,
                         env=ENV, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert undocumented(text) == [], text
    desc = description(text)
    assert desc.endswith("."), f"the description stops mid-sentence: {desc!r}"
    assert "``" not in desc, desc


def test_the_option_check_itself_sees_a_missing_help():
    import argparse  # noqa: PLC0415

    ap = argparse.ArgumentParser(description="Does a thing.")
    ap.add_argument("--documented", help="it is")
    ap.add_argument("--bare", type=int)
    ap.add_argument("--choice", choices=("a", "b"))
    assert undocumented(ap.format_help()) == ["--bare", "--choice"]


def test_top_level_usage_points_at_each_commands_help():
    out = subprocess.run([sys.executable, "-m", "kvcanary_cupy", "--help"], capture_output=True, text=True, env=ENV,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0
    assert "COMMAND --help" in out.stdout and all(c in out.stdout for c in ("selftest", "info", "report"))
    assert "python -m bench" in out.stdout  # where the benchmarks went
