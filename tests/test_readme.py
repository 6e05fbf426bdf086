"""The README's usage example runs as written."""
import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_usage_example_runs():
    text = README.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "README has no python example"
    for code in blocks:
        exec(compile(code, str(README), "exec"), {"__name__": "readme_example"})


# --- the install lines and the two commands ---------------------------------------------------
import configparser  # noqa: E402
import ast  # noqa: E402
import sys  # noqa: E402

ROOT = README.parent


def _section(text, heading):
    start = text.index(heading)
    nxt = text.find("\n## ", start + len(heading))
    return text[start:] if nxt < 0 else text[start:nxt]


def _commands():
    """The two commands, comments stripped, as README.md's block under "## The two commands" gives them."""
    block = re.search(r"```bash\n(.*?)```", _section(README.read_text(), "## The two commands"), flags=re.S)
    assert block, "README's two-commands section has no bash block"
    lines = [ln.split("#", 1)[0].strip() for ln in block.group(1).splitlines()]
    return [ln for ln in lines if ln]


def _extras():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    ex = cfg["options.extras_require"]
    return {k: [r.strip() for r in v.strip().splitlines() if r.strip()] for k, v in ex.items()}


def test_each_of_the_two_commands_installs_what_it_runs_in_one_line():
    main, tests = _commands()  # exactly two lines
    install, _, run = main.partition(" && ")
    assert install == "pip install -e ." and run == "python -m kvcanary_cupy selftest", main
    install, _, run = tests.partition(" && ")
    assert install == "pip install -e '.[test]'" and run == "python -m pytest", tests


def test_install_leads_with_the_plain_install_and_says_when_to_add_cuda():
    text = README.read_text()
    first = re.search(r"pip install[^\n`]*", text).group(0)
    assert "cuda" not in first, f"the first install line pulls in CuPy: {first}"
    assert "pip install -e ." in first
    install = _section(text, "## The two commands")
    for extra, version in (("cuda12", "CUDA 12"), ("cuda13", "CUDA 13")):
        assert f".[{extra}]" in install and version in install, extra
    assert "NumPy backend" in install


def test_every_extra_the_readme_names_exists():
    named = {x for group in re.findall(r"\.\[([\w,]+)\]", README.read_text()) for x in group.split(",")}
    assert named, "README names no extra"
    assert named <= set(_extras()), named - set(_extras())


def test_every_example_framework_has_an_extra_the_readme_names_beside_it():
    text = README.read_text()
    required = configparser.ConfigParser()
    required.read(ROOT / "setup.cfg")
    base = required["options"]["install_requires"]
    extras = _extras()
    for path in sorted((ROOT / "examples").glob("*.py")):
        mods = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                mods |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                mods.add(node.module.split(".")[0])
        third = {m for m in mods if m not in sys.stdlib_module_names and m not in ("kvcanary_cupy", "__future__")}
        for mod in third:
            if mod in base:
                continue
            assert mod in extras and any(r.startswith(mod) for r in extras[mod]), (path.name, mod)
            assert re.search(rf"\.\[([\w,]*,)?{mod}(,[\w,]*)?\][^\n]*{path.name}", text), (path.name, mod)


def test_ci_runs_the_readme_test_command_after_its_pinned_installs():
    ci = (ROOT / ".ci" / "run").read_text()
    command = _commands()[1]
    lines = [ln.strip() for ln in ci.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    at = [i for i, ln in enumerate(lines) if ln.startswith(command)]
    assert len(at) == 1, f".ci/run does not run {command!r} once"
    for pin in ("torch==2.13.0", "jax", "cuda-bindings==13.0.3", "nvidia-cuda-nvrtc==13.0.88"):
        where = [i for i, ln in enumerate(lines) if "pip install" in ln and pin in ln]
        assert where and where[0] < at[0], pin
