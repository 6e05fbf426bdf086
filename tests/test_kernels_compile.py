"""The CUDA kernels compile, without a GPU, with every name expression the backend uses.

NVRTC comes from ``cuda-bindings`` (``tests/nvrtc.py``); no driver is needed. Each
module is compiled to a cubin for sm_80 and sm_90 with the same text and options CuPy
gets (common header inlined, no include path), so a source that needs a CUDA toolkit
header fails here as it would under CuPy.
The bench's own kernels (``bench/probes.cu``, not in the library's table) are
compiled the same way, with the header inlined as the bench inlines it.

Also checked without NVRTC: the header's constants equal format.py's, and the
kernels' argument structs have the fields, in order, that the backend packs.
"""
from __future__ import annotations

import re

import pytest

from bench import probes as bench_probes
from kvcanary_cupy import format as fmt
from kvcanary_cupy import ops
from kvcanary_cupy.backends import cuda as cuda_backend
from kvcanary_cupy.backends import cuda_sources
from tests.nvrtc import compile_cubin

ARCHS = ("sm_80", "sm_90")
BENCH_PROBES = "bench/probes.cu"  # compiled by the bench, not by the library
CASES = [(fam, arch) for fam in (*cuda_sources.MODULES, BENCH_PROBES) for arch in ARCHS]


def _module(family: str):
    """(file, options, name expressions, compiled text) of a library family or the bench's probes."""
    if family == BENCH_PROBES:
        return (bench_probes.FILE.name, bench_probes.OPTIONS, bench_probes.NAME_EXPRESSIONS,
                bench_probes.source())
    spec = cuda_sources.MODULES[family]
    return spec.file, spec.options, spec.name_expressions, cuda_sources.source(family)


@pytest.mark.parametrize("family,arch", CASES)
def test_module_compiles(family, arch):
    file, options, name_expressions, src = _module(family)
    assert "#include" not in src, "the compiled text must not need any header"
    log = compile_cubin(src, file, options, name_expressions, arch)
    assert "warning" not in log, f"{file} for {arch} compiles with warnings:\n{log}"


def test_backend_uses_only_listed_names():
    """Every kernel name the backend launches is a name expression of its module."""
    text = open(cuda_backend.__file__).read()
    used = set(re.findall(r'"(kvc::[^"]+)"', text))
    listed = {ne for m in cuda_sources.MODULES.values() for ne in m.name_expressions}
    assert used == listed, f"launched but not listed: {used - listed}; listed but never launched: {listed - used}"


# --- no NVRTC needed ---------------------------------------------------------------
def _header_constants() -> dict:
    text = (cuda_sources.kernels_dir() / cuda_sources.HEADER).read_text()
    out = {}
    for name, value in re.findall(r"^inline constexpr \w+ (\w+) = (0x[0-9A-Fa-f]+|-?\d+)(?:ULL)?;", text, re.M):
        out[name] = int(value, 0)
    return out


def _python_twin(name: str) -> int:
    if name.startswith("FAIL_"):
        return int(fmt.FailReason[name[5:]])
    return int(getattr(fmt, name))


def test_header_constants_match_format():
    """Every constant of the CUDA header equals its twin in format.py."""
    h = _header_constants()
    assert h, "no constants parsed"
    for name, value in h.items():
        assert value == _python_twin(name), name
    for i, counter in enumerate(fmt.COUNTER_NAMES):
        assert h[f"CTR_{counter.upper()}"] == i, counter
    assert h["NUM_COUNTERS"] == len(fmt.COUNTER_NAMES)
    for reason in fmt.FailReason:
        if reason:
            assert h[f"FAIL_{reason.name}"] == int(reason), reason.name


def test_header_holds_only_constants_kernels_use():
    """A constant stays in the header only if kernel code (not a comment) uses it."""
    d = cuda_sources.kernels_dir()
    code = "\n".join(re.sub(r"//[^\n]*", "", (d / n).read_text()) for n in cuda_sources.files())
    for name in _header_constants():
        uses = len(re.findall(rf"\b{name}\b", code)) - 1  # less its definition
        assert uses > 0 or name == "NUM_COUNTERS", f"{name} is defined but no kernel uses it"


def test_kernels_index_counters_by_name():
    """Counters are indexed only through the header's CTR_* constants, and the
    argument structs say how long the counter array is by name, not by a number."""
    d = cuda_sources.kernels_dir()
    for name in cuda_sources.files():
        text = (d / name).read_text()
        for idx in re.findall(r"counters\s*(?:\+|\[)\s*([^)\]]+)", text):
            assert idx.strip().startswith("CTR_"), f"{name}: counters indexed by {idx.strip()!r}"
        for comment in re.findall(r"\bcounters;\s*//([^\n]*)", text):
            assert "NUM_COUNTERS" in comment, f"{name}: counters array described as {comment.strip()!r}"


def _struct_fields(file: str, struct: str) -> tuple:
    text = (cuda_sources.kernels_dir() / file).read_text()
    body = re.search(r"struct %s \{(.*?)\n\};" % struct, text, re.S).group(1)
    body = re.sub(r"//[^\n]*", "", body)
    names = []
    for decl in body.split(";"):
        decl = decl.strip()
        if not decl:
            continue
        m = re.match(r"(?:const\s+)?\w+\*?\s+(.*)$", decl, re.S)
        for n in m.group(1).split(","):
            n = n.strip().lstrip("*")
            array = re.match(r"(\w+)\[(\w+)\]$", n)  # an array of N words: fields name0 .. name{N-1}
            names += [n] if array is None else [f"{array.group(1)}{i}" for i in range(_constant(file, array.group(2)))]
    return tuple(names)


def _constant(file: str, name: str) -> int:
    """An ``inline constexpr int`` of a kernel file."""
    (value,) = re.findall(rf"\b{name} = (\d+);", (cuda_sources.kernels_dir() / file).read_text())
    return int(value)


def test_update_targets_match_backend():
    assert _constant("scatter.cu", "MAX_UPDATE_TARGETS") == cuda_backend.MAX_UPDATE_TARGETS


def test_warp_row_limit_matches_backend():
    """The backend sizes a write's grid by the rows a warp takes (at most KVC_WARP_ROW_MAX tokens)."""
    text = (cuda_sources.kernels_dir() / "write.cu").read_text()
    (value,) = re.findall(r"#define KVC_WARP_ROW_MAX (\d+)", text)
    assert int(value) == cuda_backend.WARP_ROW_MAX


def test_write_tile_layout_matches_backend():
    """The backend sizes write.cu's tile state (tiles of BLOCK * KVC_SCAN_ITEMS tokens, their
    words, the rows a tiled launch takes) by these twins."""
    text = (cuda_sources.kernels_dir() / "write.cu").read_text()
    (items,) = re.findall(r"#define KVC_SCAN_ITEMS (\d+)", text)
    twins = {"TILE_ROWS": cuda_backend.WRITE_TILE_ROWS, "TILE_STATE_WORDS": cuda_backend.TILE_STATE_WORDS,
             "TILE_DATA_WORDS": cuda_backend.TILE_DATA_WORDS}
    assert int(items) == cuda_backend.WRITE_SCAN_ITEMS
    for name, value in twins.items():
        (found,) = re.findall(rf"^inline constexpr (?:int|i64) {name} = (\d+);", text, re.M)
        assert int(found) == value, name


def test_small_plan_bounds_match_backend():
    """The bounds of plan.cu's small route, which the GPU tests of plan sizes sit on either side of."""
    text = (cuda_sources.kernels_dir() / "plan.cu").read_text()
    (rows,) = re.findall(r"^inline constexpr int SMALL_ROWS = (\d+);", text, re.M)
    (positions,) = re.findall(r"^inline constexpr i64 SMALL_ROW_MAX = (\d+);", text, re.M)
    assert (int(rows), int(positions)) == (cuda_backend.SMALL_PLAN_ROWS, cuda_backend.SMALL_PLAN_ROW_POSITIONS)


@pytest.mark.parametrize("file,struct,fields", [
    ("plan.cu", "PlanArgs", cuda_backend.PLAN_FIELDS),
    ("plan.cu", "CheckArgs", cuda_backend.CHECK_FIELDS),
    ("write.cu", "WriteArgs", cuda_backend.WRITE_FIELDS),
    ("verify.cu", "VerifyArgs", cuda_backend.VERIFY_FIELDS),
    ("scatter.cu", "ScatterArgs", cuda_backend.SCATTER_FIELDS),
    ("scatter.cu", "UpdateArgs", cuda_backend.UPDATE_FIELDS),
    ("kvcanary_common.cuh", "DigestArgs", cuda_backend.DIGEST_FIELDS),
    ("digest.cu", "AgreeArgs", cuda_backend.AGREE_FIELDS),
])
def test_argument_structs_match_backend(file, struct, fields):
    """The backend packs each struct as 8-byte words in declaration order."""
    assert _struct_fields(file, struct) == fields


def test_write_launch_argument_is_a_write_then_a_digest():
    """write_tokens takes WriteStepArgs {WriteArgs w; DigestArgs d;}: the backend packs the
    write's fields, then the digest's with a ``d_`` prefix."""
    assert _struct_fields("write.cu", "WriteStepArgs") == ("w", "d")
    assert cuda_backend.WRITE_STEP_FIELDS == (cuda_backend.WRITE_FIELDS
                                              + tuple(f"d_{f}" for f in cuda_backend.DIGEST_FIELDS))


def test_step_launch_argument_is_a_plan_a_check_then_a_write():
    """plan_verify_write_step takes PlanVerifyWriteArgs {PlanArgs p; CheckArgs c; WriteArgs w;},
    and its token bound (a thread of the last block each) is the backend's and the op's."""
    assert _struct_fields("step.cu", "PlanVerifyWriteArgs") == ("p", "c", "w")
    text = (cuda_sources.kernels_dir() / "step.cu").read_text()
    (tokens,) = re.findall(r"^inline constexpr i64 STEP_TOKENS = (\d+);", text, re.M)
    assert int(tokens) == cuda_backend.STEP_TOKENS == ops.STEP_WRITE_TOKENS == cuda_backend.BLOCK


def test_kernels_dir_found_from_checkout():
    d = cuda_sources.kernels_dir()
    for m in cuda_sources.MODULES.values():
        assert (d / m.file).is_file()


def test_plan_launch_state_size_matches_backend():
    """The backend allocates plan.cu's SYNC_WORDS words of launch state per plan."""
    text = (cuda_sources.kernels_dir() / "plan.cu").read_text()
    (words,) = re.findall(r"^inline constexpr int SYNC_WORDS = (\d+);", text, re.M)
    assert int(words) == cuda_backend.PLAN_SYNC_WORDS


def test_digest_constants_match_format():
    """digest.cu's own constants (the descriptor row, the rank limit, the agreement state's
    word order) equal their twins in format.py."""
    d = cuda_sources.kernels_dir()
    text = (d / "digest.cu").read_text() + (d / cuda_sources.HEADER).read_text()
    consts = {n: int(v) for n, v in re.findall(r"\b(\w+) = (\d+)[,;]", text)}
    assert consts["DIGEST_DESC_WORDS"] == fmt.DIGEST_DESC_WORDS
    assert consts["MAX_RANKS"] == fmt.MAX_RANKS
    assert consts["MAX_DIGEST_ROWS"] == fmt.MAX_DIGEST_ROWS
    for i, field in enumerate(fmt.AGREE_STATE_FIELDS):
        assert consts[f"ST_{field.upper()}"] == i, field
    assert len([n for n in consts if n.startswith("ST_")]) == fmt.AGREE_STATE_WORDS
    assert cuda_backend.DIGEST_STATE_WORDS == 2 and "u64* state;  // [2]" in text


def test_entry_digest_salts_match_format():
    """plan.cu digests the entry arrays with format.ENTRY_DIGEST_SALTS: its first salt, then + 1, + 2, + 3."""
    text = (cuda_sources.kernels_dir() / "plan.cu").read_text()
    (first,) = re.findall(r"^inline constexpr i64 ENTRY_DIGEST_SALT = (\d+);", text, re.M)
    assert tuple(int(first) + k for k in range(4)) == fmt.ENTRY_DIGEST_SALTS
