"""``python -m kvcanary_cupy`` and the ``kvcanary`` console script as a user meets them: unknown
arguments refused by every command, ``--version``, and usage lines that name the program the
user ran."""
from __future__ import annotations

import configparser
import os
import subprocess
import sys

import pytest

import kvcanary_cupy
from tests.fake_cupy import NOT_INSTALLED, ROOT, fake_cupy_env

MODULE = [sys.executable, "-m", "kvcanary_cupy"]


def run(cmd, env, cwd):
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=120)


@pytest.fixture
def env(tmp_path):
    return fake_cupy_env(tmp_path, NOT_INSTALLED)


@pytest.fixture
def console_script(tmp_path):
    """The ``kvcanary`` script pip writes for setup.cfg's console_scripts entry (same text as
    pip's launcher, without the interpreter line), in a bin/ folder of its own."""
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    entries = dict(line.split("=", 1) for line in cfg["options.entry_points"]["console_scripts"].split("\n")
                   if line.strip())
    entries = {k.strip(): v.strip() for k, v in entries.items()}
    module, func = entries["kvcanary"].split(":")
    script = tmp_path / "bin" / "kvcanary"
    script.parent.mkdir()
    script.write_text(f"import re\nimport sys\nfrom {module} import {func}\n"
                      "if __name__ == '__main__':\n"
                      "    sys.argv[0] = re.sub(r'(-script\\.pyw|\\.exe)?$', '', sys.argv[0])\n"
                      f"    sys.exit({func}())\n")
    return [sys.executable, str(script)]


def assert_refused(out, command: str, bad: str, prog: str):
    """Exit 2, nothing on stdout, stderr: one ``kvcanary: COMMAND:`` line naming ``bad``, then the usage."""
    assert out.returncode == 2, (out.returncode, out.stdout, out.stderr)
    assert out.stdout == "" and "Traceback" not in out.stderr, out.stderr
    first, *rest = out.stderr.splitlines()
    assert first.startswith(f"kvcanary: {command}: ") and bad in first, out.stderr
    assert rest and rest[0].startswith(f"usage: {prog} {command}"), out.stderr


@pytest.mark.parametrize("command", ["info", "selftest"])
@pytest.mark.parametrize("bad", ["--bogus", "stray"])
def test_every_command_refuses_an_unknown_argument(env, tmp_path, command, bad):
    out = run([*MODULE, command, bad], env, tmp_path)
    assert_refused(out, command, bad, "python -m kvcanary_cupy")


@pytest.mark.parametrize("args", [["--bogus", "events.jsonl"], ["events.jsonl", "stray"]])
def test_report_refuses_an_unknown_argument(env, tmp_path, args):
    out = run([*MODULE, "report", *args], env, tmp_path)  # its one positional argument is the events file
    assert_refused(out, "report", args[0] if args[0].startswith("-") else args[1], "python -m kvcanary_cupy")


def test_a_bad_option_value_is_the_same_one_line_error(env, tmp_path):
    out = run([*MODULE, "selftest", "--steps", "many"], env, tmp_path)
    assert_refused(out, "selftest", "--steps", "python -m kvcanary_cupy")


def test_info_still_runs_and_has_a_help(env, tmp_path):
    out = run([*MODULE, "info"], env, tmp_path)
    assert out.returncode == 0 and out.stdout.startswith(f"kvcanary_cupy {kvcanary_cupy.__version__}\n")
    out = run([*MODULE, "info", "--help"], env, tmp_path)
    assert out.returncode == 0 and out.stdout.startswith("usage: python -m kvcanary_cupy info")


def test_version(env, tmp_path, console_script):
    for cmd in (MODULE, console_script):
        out = run([*cmd, "--version"], env, tmp_path)
        assert out.returncode == 0 and out.stderr == "", out.stderr
        assert out.stdout == f"kvcanary_cupy {kvcanary_cupy.__version__}\n"
    out = run([*MODULE, "--version", "--bogus"], env, tmp_path)
    assert out.returncode == 2 and out.stderr.startswith("kvcanary: ") and out.stdout == ""


@pytest.mark.parametrize("bad", ["--bogus", "selfcheck"])
def test_an_unknown_command_or_option_says_what_was_expected(env, tmp_path, bad):
    out = run([*MODULE, bad], env, tmp_path)
    assert out.returncode == 2 and out.stdout == ""
    first, *rest = out.stderr.splitlines()
    assert first.startswith("kvcanary: ") and repr(bad) in first, first
    assert first.endswith("expected selftest, info, report or --version") and rest[0].startswith("usage: "), first


def test_usage_names_the_program_as_invoked(env, tmp_path, console_script):
    out = run([*console_script, "--help"], env, tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: kvcanary {selftest,info,report}") and "kvcanary --version" in out.stdout
    assert "python -m kvcanary_cupy" not in out.stdout and "kvcanary COMMAND --help" in out.stdout
    out = run([*console_script, "selftest", "--help"], env, tmp_path)
    assert out.returncode == 0 and out.stdout.startswith("usage: kvcanary selftest"), out.stdout
    assert_refused(run([*console_script, "info", "--bogus"], env, tmp_path), "info", "--bogus", "kvcanary")
    assert_refused(run([*console_script, "selftest", "--bogus"], env, tmp_path), "selftest", "--bogus", "kvcanary")
    assert_refused(run([*console_script, "report", "--bogus"], env, tmp_path), "report", "--bogus", "kvcanary")
    out = run([*MODULE, "--help"], env, tmp_path)
    assert out.returncode == 0 and out.stdout.startswith("usage: python -m kvcanary_cupy {selftest,info,report}")
