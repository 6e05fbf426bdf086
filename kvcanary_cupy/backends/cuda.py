"""The CUDA backend: the kernels of ``kernels_cu/``, compiled by CuPy (NVRTC).

Implements :class:`kvcanary_cupy.backends.Backend`: ops.py hands it validated
CuPy views and the stream, and it returns a prepared launch.

Host cost. Each kernel takes one argument, a struct of 8-byte fields (see the
``*Args`` structs in the ``.cu`` files; ``*_FIELDS`` below mirror them and a
test keeps both equal). A prepared launch packs that struct once into a NumPy
buffer and then costs one ``cuLaunchKernel`` per call; ops keeps it while the
caller passes the same arguments (:class:`kvcanary_cupy.launch_cache.LaunchCache`).
The driver copies the struct at launch (and a graph capture copies it into
the graph), so a launch can be dropped at any time.

Device memory a launch points at has an owner of its own: a plan's launch state
lives as long as the plan (in the plan's ``launches.state``), a fold table as
long as every real-KV source it describes (see :func:`_fold_table`).

Graphs. Grids derive from shapes only (capacity, max_batch, batch size, input
lengths, resident blocks), never from data, and nothing here allocates,
synchronizes or reads the device on the hot path. Preparing does a little
once: the first plan of a plan object allocates and zeroes its launch state on
the op's stream; the first launch with a new set of real-KV sources uploads
their fold descriptors; the first launch of a kernel family compiles (or loads
from CuPy's cache) its module. Make those first calls before a graph capture.
"""
from __future__ import annotations

import threading
import weakref

import numpy as np

from .. import runtime
from .. import format as fmt
from ..format import RealKvMode
from . import cuda_sources

BLOCK = 256  # threads per block for every kernel (the kernels accept any multiple of 32)
BLOCKS_PER_SM = 8  # 2048 resident threads per SM at 256 per block

# Field order of the kernels' argument structs (kernels_cu/*.cu).
PLAN_FIELDS = (
    "rpi", "pre", "ext", "table", "lut", "etab", "evl", "widths", "bs", "nreq", "twidth", "page", "lut_len",
    "swa_size", "erows", "ewidth", "eoffset",
    "vp_slot", "vp_prev", "vp_epos", "vp_etok", "vp_offsets", "vp_num_valid", "vp_enable", "vp_requested",
    "vp_input_errors", "vp_overflows", "vp_max_requested", "vp_first_error", "vp_capacity", "vp_max_batch",
    "wp_offsets", "wp_seeds", "wp_num_rows", "wp_input_errors", "wp_max_batch", "sync", "small_max",
)
WRITE_FIELDS = (
    "records", "num_slots", "offsets", "seeds", "num_rows", "position_check", "max_batch",
    "input_ids", "positions", "out_cache_loc", "exp_tokens", "exp_positions", "widths", "avail",
    "ring", "head", "ring_capacity", "counters", "tag", "folds", "num_folds", "tiles", "tile_cap", "table_cap",
)
VERIFY_FIELDS = (
    "records", "num_slots", "slot_indices", "prev_slot_indices", "expected_positions", "expected_tokens",
    "offsets", "offsets_len", "num_valid", "enable", "capacity", "ring", "head", "ring_capacity", "counters",
    "tag", "check_tokens", "folds", "num_folds", "sample_state", "period",
)
# plan_verify_step's argument: PLAN_FIELDS, then these (plan.cu CheckArgs).
CHECK_FIELDS = (
    "records", "num_slots", "ring", "head", "ring_capacity", "counters", "tag", "check_tokens", "folds", "num_folds",
    "sample_state", "period", "digest",
)
# plan_verify_write_step's argument (step.cu PlanVerifyWriteArgs): PLAN_FIELDS, then
# CHECK_FIELDS with a ``c_`` prefix, then WRITE_FIELDS with a ``w_`` prefix.
STEP_TOKENS = 256  # step.cu STEP_TOKENS: the most input tokens plan_verify_write stamps
SCATTER_FIELDS = ("table", "nreq", "width", "tokens", "ntok", "offsets", "req_pool_indices", "bs", "widths", "errors")
MAX_UPDATE_TARGETS = 4  # scatter.cu
UPDATE_FIELDS = (("words", "copy_to", "copy_words", "shift", "index", "value", "count")
                 + tuple(f"{f}{t}" for f in ("target", "target_len", "end") for t in range(MAX_UPDATE_TARGETS))
                 + ("skipped", "rows_from", "rows_from_stride", "row_count", "row_width", "rows_to", "rows_to_count",
                    "rows_to_width"))
DIGEST_FIELDS = ("descs", "num_descs", "out", "state", "carry", "carry_words")
# write_tokens' argument (write.cu WriteStepArgs): WRITE_FIELDS, then a digest's (all 0: none).
WRITE_STEP_FIELDS = WRITE_FIELDS + tuple(f"d_{k}" for k in DIGEST_FIELDS)
AGREE_FIELDS = ("gathered", "world", "words", "rank", "state", "ring", "head", "ring_capacity", "tag")
DIGEST_STATE_WORDS = 2  # digest.cu: the partial sum and the finished-block ticket
HAS_ETOK, HAS_EPOS = 1 << 5, 1 << 6  # write.cu widths bits
WARP_ROW_MAX = 128  # write.cu KVC_WARP_ROW_MAX: longer rows of the scan chain take a block each
# write.cu's tiles: a scan-chain launch of at most WRITE_TILE_ROWS rows cuts its long rows into
# tiles of BLOCK * WRITE_SCAN_ITEMS tokens spread over the grid. Its state: TILE_STATE_WORDS,
# then (1 + TILE_DATA_WORDS) words per tile, then two hash tables.
WRITE_SCAN_ITEMS = 1  # write.cu KVC_SCAN_ITEMS
WRITE_TILE_ROWS, TILE_STATE_WORDS, TILE_DATA_WORDS = 256, 4, 8
WRITE_TILE_TOKENS = BLOCK * WRITE_SCAN_ITEMS  # a tile: one block step
# Inputs of at most this many tokens keep a block per long row: two block steps at most.
WRITE_TILE_MIN = 2 * WRITE_TILE_TOKENS

# The kernel instances, by (real-KV sources given, scan chain).
WRITE_KERNELS = {(False, False): "kvc::write_tokens<false, false, true>",
                 (False, True): "kvc::write_tokens<false, true, true>",
                 (True, False): "kvc::write_tokens<true, false, true>", (True, True): "kvc::write_tokens<true, true, true>"}
# Scan-chain writes none of whose rows can be longer than WARP_ROW_MAX tokens (the inputs hold
# no more, or the caller's max_row_tokens says so), by real-KV sources given: every row a warp,
# none of the long rows' shared memory.
WRITE_SHORT_KERNELS = {False: "kvc::write_tokens<false, true, false>", True: "kvc::write_tokens<true, true, false>"}
# Their launches of at most SHORT_WRITE_ROWS rows take blocks of SHORT_WRITE_BLOCK threads (write.cu
# takes any multiple of 32 from 64 to 256: its MUL_POW copy is a thread per word, 33 words).
SHORT_WRITE_ROWS, SHORT_WRITE_BLOCK = 1024, 128
VERIFY_KERNELS = {(False, False): "kvc::verify_entries<false, false>",
                  (False, True): "kvc::verify_entries<false, true>",
                  (True, False): "kvc::verify_entries<true, false>", (True, True): "kvc::verify_entries<true, true>"}
STEP_KERNELS = {(False, False): "kvc::plan_verify_write_step<false>",
                (False, True): "kvc::plan_verify_write_step<true>"}  # no real-KV folds
PLAN_VERIFY_KERNELS = {(False, False): "kvc::plan_verify_step<false, false>",
                       (False, True): "kvc::plan_verify_step<false, true>",
                       (True, False): "kvc::plan_verify_step<true, false>",
                       (True, True): "kvc::plan_verify_step<true, true>"}


def _ptr(a) -> int:
    """Device address of a CuPy view (patched to host addresses by CPU emulation tests)."""
    return a.data.ptr


def _wide(a) -> int:
    return a.itemsize >> 3  # 1 for int64, 0 for int32


def _i64(x: int) -> int:
    """An int as the int64 bit pattern the kernels read (tags may be any int)."""
    x &= 0xFFFFFFFFFFFFFFFF
    return x - (1 << 64) if x >> 63 else x


# --- runtime: compile, launch, the few allocations -----------------------------
class _CupyRuntime:
    """Modules compiled once per process (CuPy caches the binaries on disk too),
    loaded once per device; launches go straight to ``cuLaunchKernel``."""

    def __init__(self):
        import cupy  # noqa: PLC0415
        from cupy_backends.cuda.api import driver, runtime  # noqa: PLC0415

        self.cp = cupy
        self._driver = driver
        self.launch_kernel = driver.launchKernel
        self.current_device = runtime.getDevice
        self._runtime = runtime
        self._modules: dict[str, object] = {}
        self._functions: dict[tuple[str, int], object] = {}
        self._sms: dict[int, int] = {}
        self._resident: dict[int, int] = {}
        self._lock = threading.Lock()

    def function(self, family: str, name: str, dev: int) -> int:
        f = self._functions.get((name, dev))
        if f is None:
            with self._lock, self.cp.cuda.Device(dev):
                mod = self._modules.get(family)
                if mod is None:
                    spec = cuda_sources.MODULES[family]
                    mod = self.cp.RawModule(code=cuda_sources.source(family), options=spec.options,
                                            name_expressions=spec.name_expressions)
                    self._modules[family] = mod
                f = mod.get_function(name).kernel  # compiles / loads for this device
                self._functions[(name, dev)] = f
        return f.ptr

    def resident_blocks(self, fn: int, dev: int) -> int:
        """Blocks of BLOCK threads of kernel ``fn`` that fit on the device at once: the
        grid of a grid-stride kernel, so no block waits for a second wave (the compiler's
        register use, not __launch_bounds__, decides how many fit)."""
        n = self._resident.get(fn)
        if n is None:
            try:
                per_sm = int(self._driver.occupancyMaxActiveBlocksPerMultiprocessor(fn, BLOCK, 0))
            except Exception:  # noqa: BLE001  (a CuPy without the occupancy call: assume full residency)
                per_sm = BLOCKS_PER_SM
            n = self._resident[fn] = max(1, per_sm) * self.sm_count(dev)
        return n

    def sm_count(self, dev: int) -> int:
        n = self._sms.get(dev)
        if n is None:
            n = self._sms[dev] = int(self._runtime.deviceGetAttribute(
                self._runtime.cudaDevAttrMultiProcessorCount, dev))
        return n

    def device(self, dev: int):
        return self.cp.cuda.Device(dev)

    def empty_i64(self, n: int, dev: int):
        with self.cp.cuda.Device(dev):
            return self.cp.empty(n, dtype=np.int64)

    def zero_async(self, ptr: int, nbytes: int, stream: int) -> None:
        self._runtime.memsetAsync(ptr, 0, nbytes, stream)

    def upload_i64(self, host: np.ndarray, dev: int, stream: int):
        with self.cp.cuda.Device(dev), runtime.on_cupy_stream(stream, dev):
            return self.cp.asarray(host)

    def default_stream(self) -> int:
        return self.cp.cuda.get_current_stream().ptr


_rt = None


def _runtime():
    global _rt
    if _rt is None:
        _rt = _CupyRuntime()
    return _rt


def _dev(a) -> int:
    return a.device.id


class _Launch:
    """One kernel with its packed argument struct, ready to launch on any stream."""

    __slots__ = ("fn", "grid", "block", "dev", "buf", "params_ptr", "params", "index")

    def __init__(self, fields, fn: int, dev: int, values: dict, grid: int, block: int = BLOCK):
        self.index = {f: i for i, f in enumerate(fields)}
        self.buf = np.zeros(len(fields), dtype=np.int64)
        for k, v in values.items():
            self.buf[self.index[k]] = v
        # cuLaunchKernel's kernelParams: one pointer, to the struct.
        self.params = np.array([self.buf.ctypes.data], dtype=np.uint64)
        self.params_ptr = int(self.params.ctypes.data)  # .ctypes costs a microsecond: read it once
        self.fn, self.dev, self.grid, self.block = fn, dev, grid, block

    def __call__(self, stream: int) -> None:
        rt = _rt
        if rt.current_device() != self.dev:
            with rt.device(self.dev):
                rt.launch_kernel(self.fn, self.grid, 1, 1, self.block, 1, 1, 0, stream, self.params_ptr, 0)
            return
        rt.launch_kernel(self.fn, self.grid, 1, 1, self.block, 1, 1, 0, stream, self.params_ptr, 0)


class _OwningLaunch(_Launch):
    """A launch that owns device memory its kernel reads (a descriptor table, launch state):
    it lives exactly as long as the launch."""

    __slots__ = ("owned",)


def _aligned16(a, name: str) -> int:
    """The address of an array the kernels read or write with 16-byte accesses."""
    p = _ptr(a)
    if p % 16:
        raise ValueError(f"kvcanary: {name}: expected 16-byte aligned data (the kernels move records and violation "
                         f"rows in 16-byte words), got an address {p:#x}; allocate it with the library or a framework")
    return p


def _blocks(threads: int, resident: int) -> int:
    """Grid of a grid-stride kernel: enough blocks for ``threads``, at most one full wave."""
    return max(1, min(-(-threads // BLOCK), resident))


def _stream(stream) -> int:
    return _runtime().default_stream() if stream is None else stream


# --- real-KV fold descriptors -------------------------------------------------
# A fold table lives as long as every source it describes, and no longer: its key
# holds the sources' ids, never the sources, and a finalizer on each drops it when
# one is collected. Holding them would keep every KV pool ever passed alive (a JAX
# engine passes a new pool array each step). Dropping is safe for captured CUDA
# graphs: a graph that captured a fold table also captured the pool addresses it
# holds, so it cannot meaningfully outlive the pools. An id cannot be reused while
# its entry exists: the finalizer runs when the object dies, before its memory
# (and id) can go to another object.
_fold_tables: dict = {}  # (source ids, mode, device) -> (device array [F, 4], F)


def _fold_table(sources, mode, dev: int, stream: int):
    """(device array [F, FOLD_DESC_WORDS] or None, F): one row per (source, layer): base
    address, bytes per token, 16-byte chunks hashed."""
    if mode == RealKvMode.NONE or not sources:
        return None, 0
    key = (tuple(map(id, sources)), int(mode), dev)
    hit = _fold_tables.get(key)
    if hit is not None:
        return hit
    rows = []
    for src in sources:
        eff = fmt.KV_CHUNK_BYTES if mode == RealKvMode.PARTIAL else src.read_bytes
        base = _ptr(src.data)
        for layer in range(src.num_layers):
            rows.append((base + layer * src.layer_bytes, src.bytes_per_token, eff // fmt.KV_CHUNK_BYTES, 0))
    host = np.array(rows, dtype=np.int64).reshape(-1, fmt.FOLD_DESC_WORDS)
    entry = _fold_tables[key] = (_runtime().upload_i64(host, dev, stream), host.shape[0])
    for src in {id(s): s for s in sources}.values():
        weakref.finalize(src, _fold_tables.pop, key, None).atexit = False
    return entry


# --- plan --------------------------------------------------------------------
PLAN_SYNC_WORDS = 1312  # plan.cu SYNC_WORDS: plan_step's launch state
# plan.cu's small route (each warp checks its own entries, no grid-wide wait) is taken up
# to this many entries in a step. Measured on an H200 at 1Mi entries (256 rows of 4096):
# plan 30.0 against 32.9 us and a stamped monitor step 58.9 against 69.6 us for the
# rows-scan-fill phases.
SMALL_PLAN_ENTRIES = 1 << 20
# ... and only by steps of at most SMALL_PLAN_ROWS rows (plan.cu SMALL_ROWS), none reading
# more than SMALL_PLAN_ROW_POSITIONS positions (plan.cu SMALL_ROW_MAX).
SMALL_PLAN_ROWS, SMALL_PLAN_ROW_POSITIONS = 256, 8192


def _sync_state(owner, dev: int, stream: int) -> int:
    """The address of the plan's launch state (PLAN_SYNC_WORDS int64), kept in the plan's
    own ``launches.state`` so it lives as long as the plan. A new state is zeroed on the
    op's stream, so it is 0 when the plan's first launch runs (and stays 0 between
    launches: the last block out resets it)."""
    key = ("plan_sync", dev)
    state = owner.launches.state.get(key)
    if state is None:
        rt = _runtime()
        state = owner.launches.state[key] = rt.empty_i64(PLAN_SYNC_WORDS, dev)
        rt.zero_async(_ptr(state), 8 * PLAN_SYNC_WORDS, stream)
    return _ptr(state)


def _plan_values(vp, wp, *, req_pool_indices, prefix_lens, extend_lens, table, page_size, swa, expected,
                 stream: int) -> tuple[dict, int, int, int]:
    """(PLAN_FIELDS values, device, grid threads, most verify entries) of a plan. A step's entries
    are bounded by shapes alone: the plan's capacity, and each row's positions (the table's
    width, or the window), so a small step of a large plan gets a small grid."""
    owner = vp if vp is not None else wp
    dev = _dev(owner.offsets)
    bs = req_pool_indices.shape[0]
    widths = (_wide(req_pool_indices) | _wide(prefix_lens) << 1 | _wide(extend_lens) << 2 | _wide(table) << 3)
    v = dict(rpi=_ptr(req_pool_indices), pre=_ptr(prefix_lens), ext=_ptr(extend_lens), table=_ptr(table),
             bs=bs, nreq=table.shape[0], twidth=table.shape[1], page=page_size, lut_len=-1, erows=-1,
             sync=_sync_state(owner, dev, stream), small_max=SMALL_PLAN_ENTRIES)
    if swa is not None:
        v.update(swa_size=swa.size)
        if swa.lut is not None:
            v.update(lut=_ptr(swa.lut), lut_len=swa.lut.shape[0])
            widths |= _wide(swa.lut) << 4
    if expected is not None:
        et, evl = expected.table, expected.valid_lens
        v.update(etab=_ptr(et), evl=_ptr(evl), erows=et.shape[0], ewidth=et.shape[1], eoffset=expected.offset)
        widths |= _wide(et) << 5 | _wide(evl) << 6
    v["widths"] = widths
    if vp is not None:
        v.update(vp_slot=_ptr(vp.slot_indices), vp_prev=_ptr(vp.prev_slot_indices),
                 vp_epos=_ptr(vp.expected_positions), vp_etok=_ptr(vp.expected_tokens),
                 vp_offsets=_ptr(vp.offsets), vp_num_valid=_ptr(vp.num_valid), vp_enable=_ptr(vp.enable),
                 vp_requested=_ptr(vp.requested), vp_input_errors=_ptr(vp.input_errors),
                 vp_overflows=_ptr(vp.overflows), vp_max_requested=_ptr(vp.max_requested),
                 vp_first_error=_ptr(vp.first_input_error), vp_capacity=vp.capacity, vp_max_batch=vp.max_batch)
    if wp is not None:
        v.update(wp_offsets=_ptr(wp.offsets), wp_seeds=_ptr(wp.seed_slots), wp_num_rows=_ptr(wp.num_rows),
                 wp_input_errors=_ptr(wp.input_errors), wp_max_batch=wp.max_batch)
    per_row = table.shape[1] * page_size if swa is None else min(table.shape[1] * page_size, swa.size)
    entries = min(vp.capacity, bs * per_row) if vp is not None else 0
    return v, dev, max(bs * BLOCK, entries), entries  # a block per batch row, a thread per entry


def prepare_plan(vp, wp, *, stream=None, **inputs) -> _Launch:
    """See :func:`kvcanary_cupy.ops.plan`; views already validated."""
    rt = _runtime()
    v, dev, threads, _ = _plan_values(vp, wp, stream=_stream(stream), **inputs)
    fn = rt.function("plan", "kvc::plan_step", dev)
    return _Launch(PLAN_FIELDS, fn, dev, v, _blocks(threads, rt.resident_blocks(fn, dev)))


def prepare_plan_and_verify(vp, wp, canary, *, log, tag, sources, mode, check_tokens, sample, digest=None,
                            stream=None, **plan_inputs) -> _Launch:
    """See :func:`kvcanary_cupy.ops.plan_and_verify`; views already validated. One launch
    of plan_verify_step: the plan's fill checks each entry instead of writing it."""
    stream = _stream(stream)
    v, dev, threads, entries = _plan_values(vp, wp, stream=stream, **plan_inputs)
    fn, dev, nf, c = _canary_fields("plan", PLAN_VERIFY_KERNELS, canary, log, tag, sources, mode, stream)
    c.update(check_tokens=1 if check_tokens else 0, sample_state=_ptr(sample.state) if sample is not None else 0,
             period=sample.period if sample is not None else 1, digest=_ptr(digest) if digest is not None else 0)
    values = {**v, **{f"c_{k}": x for k, x in c.items()}}
    fields = PLAN_FIELDS + tuple(f"c_{k}" for k in CHECK_FIELDS)
    threads = max(threads, entries * (min(nf, 32) if nf else 1))
    return _Launch(fields, fn, dev, values, _blocks(threads, _runtime().resident_blocks(fn, dev)))


def prepare_plan_verify_write(vp, wp, canary, *, log, tag, write_tag, check_tokens, input_ids, positions,
                              out_cache_loc, expected_tokens, expected_positions, stream=None,
                              **plan_inputs) -> _Launch:
    """See :func:`kvcanary_cupy.ops.plan_verify_write`; views already validated. One launch of
    plan_verify_write_step: plan_and_verify's, whose last block out then stamps the tokens."""
    stream = _stream(stream)
    v, dev, threads, _ = _plan_values(vp, wp, stream=stream, **plan_inputs)
    fn, dev, _, canary_log = _canary_fields("step", STEP_KERNELS, canary, log, tag, (), RealKvMode.NONE, stream)
    c = dict(canary_log, check_tokens=1 if check_tokens else 0, sample_state=0, period=1, digest=0)
    w = dict(canary_log, tag=_i64(write_tag))  # the same canary and log, the write's tag
    _write_inputs(w, wp, input_ids, positions, out_cache_loc, expected_tokens, expected_positions)
    values = {**v, **{f"c_{k}": x for k, x in c.items()}, **{f"w_{k}": x for k, x in w.items()}}
    fields = PLAN_FIELDS + tuple(f"c_{k}" for k in CHECK_FIELDS) + tuple(f"w_{k}" for k in WRITE_FIELDS)
    return _Launch(fields, fn, dev, values, _blocks(threads, _runtime().resident_blocks(fn, dev)))


def _write_inputs(v: dict, wp, input_ids, positions, out_cache_loc, expected_tokens, expected_positions) -> int:
    """Adds a write's plan and token inputs to its WRITE_FIELDS values ``v`` (``widths``: which
    inputs are int64, which expected ones are given); returns ``avail``, the shortest input."""
    v.update(offsets=_ptr(wp.offsets), seeds=_ptr(wp.seed_slots), num_rows=_ptr(wp.num_rows),
             position_check=_ptr(wp.position_check), max_batch=wp.max_batch, input_ids=_ptr(input_ids),
             positions=_ptr(positions), out_cache_loc=_ptr(out_cache_loc))
    avail = min(input_ids.shape[0], positions.shape[0], out_cache_loc.shape[0])
    widths = _wide(input_ids) | _wide(positions) << 1 | _wide(out_cache_loc) << 2
    if expected_tokens is not None:
        avail = min(avail, expected_tokens.shape[0])
        widths |= _wide(expected_tokens) << 3 | HAS_ETOK
        v["exp_tokens"] = _ptr(expected_tokens)
    if expected_positions is not None:
        avail = min(avail, expected_positions.shape[0])
        widths |= _wide(expected_positions) << 4 | HAS_EPOS
        v["exp_positions"] = _ptr(expected_positions)
    v.update(widths=widths, avail=avail)
    return avail


# --- write and verify ------------------------------------------------------------
def _canary_fields(family, kernels, canary, log, tag, sources, mode, stream: int):
    """(kernel, device, fold count, fields): the instance of ``kernels`` (by real-KV folds
    given, scan chain) for this call, and the canary, log, tag and fold fields write,
    verify and plan_and_verify share."""
    dev = _dev(canary.records)
    folds, nf = _fold_table(sources, mode, dev, stream)
    fn = _runtime().function(family, kernels[(nf > 0, canary.chain == fmt.CHAIN_SCAN)], dev)
    return fn, dev, nf, dict(
        records=_aligned16(canary.records, "canary.records"), num_slots=canary.num_slots,
        ring=_aligned16(log.ring, "log.ring"), head=_ptr(log.head), ring_capacity=log.capacity,
        counters=_ptr(log.counter_array), tag=_i64(tag), folds=_ptr(folds) if nf else 0, num_folds=nf)


def _write_tiles(wp, dev: int, avail: int, stream: int) -> tuple[int, int, int]:
    """(address, tiles, hash-table words) of the write plan's tile state, with room for
    ``avail`` input tokens; kept in the plan's ``launches.state``. A state too small for
    ``avail`` is replaced by a larger one, zeroed on the op's stream; the old one is kept
    as long as the plan (a captured graph may still point at it)."""
    rt = _runtime()
    key = ("write_tiles", dev)
    have = wp.launches.state.get(key)
    tile_cap = -(-avail // WRITE_TILE_TOKENS) + WRITE_TILE_ROWS  # a partial tile per row at most
    table_cap = max(64, 1 << (2 * avail - 1).bit_length())
    if have is None or have[1] < tile_cap or have[2] < table_cap:
        if have is not None:
            wp.launches.state.setdefault(("write_tiles_retired", dev), []).append(have)
        words = TILE_STATE_WORDS + tile_cap * (1 + TILE_DATA_WORDS) + 2 * table_cap
        state = rt.empty_i64(words, dev)
        rt.zero_async(_ptr(state), 8 * words, stream)
        have = wp.launches.state[key] = (state, tile_cap, table_cap)
    return _ptr(have[0]), have[1], have[2]


def prepare_write(canary, wp, *, input_ids, positions, out_cache_loc, log, tag, sources, mode, expected_tokens,
                  expected_positions, max_row_tokens=None, digest=None, stream=None) -> _Launch:
    """See :func:`kvcanary_cupy.ops.write`; views already validated. With ``digest`` (a
    :class:`~kvcanary_cupy.digest.Digest`), one extra block of the launch computes it."""
    stream = _stream(stream)
    fn, dev, nf, v = _canary_fields("write", WRITE_KERNELS, canary, log, tag, sources, mode, stream)
    avail = _write_inputs(v, wp, input_ids, positions, out_cache_loc, expected_tokens, expected_positions)
    # A warp per row for the chain (a scan chain's long rows: a block per row, when a row may be
    # long: the inputs could hold one and the caller gave no bound that rules it out); with
    # folds, up to 32 lanes per token fingerprint.
    scan = canary.chain == fmt.CHAIN_SCAN
    longest = avail if max_row_tokens is None else min(avail, max_row_tokens)
    short = scan and longest <= WARP_ROW_MAX
    if short:
        fn = _runtime().function("write", WRITE_SHORT_KERNELS[nf > 0], dev)
    per_row = BLOCK if scan and not short else 32
    threads = max(wp.max_batch * per_row, avail * min(nf, 32))
    # Long rows cut into tiles: a block per tile, as many as fit at once (the tiles wait for
    # earlier ones, so the whole grid must be resident; a slot and a token index are 32-bit
    # keys of its hash table).
    if scan and not short and WRITE_TILE_MIN < avail < 1 << 31 and canary.num_slots < (1 << 32) - 1:
        v["tiles"], v["tile_cap"], v["table_cap"] = _write_tiles(wp, dev, avail, stream)
        threads = max(threads, -(-avail // WRITE_TILE_TOKENS) * BLOCK)
    if short and digest is None and wp.max_batch <= SHORT_WRITE_ROWS:
        # Decode-shaped steps in half blocks: half the rows per SM (bs 64 / 256 behind an L2
        # flush on an H200: 6.9 / 7.0 to 6.5-6.6 / 6.5-6.7 us; bs 4096 is slower so). A block of
        # SHORT_WRITE_BLOCK threads needs at most half a full block's registers, so twice as many fit.
        grid = max(1, min(-(-threads // SHORT_WRITE_BLOCK), 2 * _runtime().resident_blocks(fn, dev)))
        return _Launch(WRITE_STEP_FIELDS, fn, dev, v, grid, SHORT_WRITE_BLOCK)
    blocks = _blocks(threads, _runtime().resident_blocks(fn, dev))
    if digest is None:
        return _Launch(WRITE_STEP_FIELDS, fn, dev, v, blocks)
    d, owned = _digest_values(digest.rows, out=digest.out, carry=digest.carry, dev=dev, stream=stream)
    launch = _OwningLaunch(WRITE_STEP_FIELDS, fn, dev, {**v, **{f"d_{k}": x for k, x in d.items()}}, blocks + 1)
    launch.owned = owned
    return launch


def prepare_verify(canary, vp, *, log, tag, sources, mode, check_tokens, sample, stream=None) -> _Launch:
    """See :func:`kvcanary_cupy.ops.verify`; views already validated."""
    stream = _stream(stream)
    fn, dev, nf, v = _canary_fields("verify", VERIFY_KERNELS, canary, log, tag, sources, mode, stream)
    v.update(slot_indices=_ptr(vp.slot_indices), prev_slot_indices=_ptr(vp.prev_slot_indices),
             expected_positions=_ptr(vp.expected_positions), expected_tokens=_ptr(vp.expected_tokens),
             offsets=_ptr(vp.offsets), offsets_len=vp.offsets.shape[0], num_valid=_ptr(vp.num_valid),
             enable=_ptr(vp.enable), capacity=vp.capacity, check_tokens=1 if check_tokens else 0,
             sample_state=_ptr(sample.state) if sample is not None else 0,
             period=sample.period if sample is not None else 1)
    threads = vp.capacity * (min(nf, 32) if nf else 1)
    return _Launch(VERIFY_FIELDS, fn, dev, v, _blocks(threads, _runtime().resident_blocks(fn, dev)))


# --- scatter_expected_tokens ---------------------------------------------------
def prepare_scatter(table, *, tokens, offsets, req_pool_indices, input_errors=None, stream=None) -> _Launch:
    """See :func:`kvcanary_cupy.ops.scatter_expected_tokens`; views already validated."""
    rt = _runtime()
    dev = _dev(table)
    bs = req_pool_indices.shape[0]
    widths = _wide(table) | _wide(tokens) << 1 | _wide(offsets) << 2 | _wide(req_pool_indices) << 3
    v = dict(table=_ptr(table), nreq=table.shape[0], width=table.shape[1], tokens=_ptr(tokens),
             ntok=tokens.shape[0], offsets=_ptr(offsets), req_pool_indices=_ptr(req_pool_indices), bs=bs,
             widths=widths, errors=0 if input_errors is None else _ptr(input_errors))
    fn = rt.function("scatter", "kvc::scatter_expected_tokens", dev)
    return _Launch(SCATTER_FIELDS, fn, dev, v, max(1, min(bs, rt.sm_count(dev) * 4)))  # a block per row


# --- host-built updates -----------------------------------------------------------
class HostUpdates:
    """Changes a host prepares in pinned memory for device arrays, applied by one launch
    that reads them in place (pinned memory is mapped into the device's address space
    under unified addressing): an engine adapter's per-step rows and table changes for
    the cost of one kernel launch, with no copy call and no framework op.

    Args:
        words: address of int64 words (pinned host or device memory) copied to ``copy_to``.
        copy_to: device address of the int64 words they go to.
        targets: up to :data:`MAX_UPDATE_TARGETS` ``(device address, length)`` of int32 arrays.
        device: the CUDA ordinal.
        skipped: device address of an int64 counter that every launch adds its skipped
            updates to (several launchers may share one); 0: a counter of its own.
        rows_to: ``(device address, rows, width)`` of an int32 table that calls may copy
            table rows into (see ``rows_from``), or None.

    :meth:`__call__` copies ``copy_words`` words with ``shift`` added, then applies the
    updates: int64 indices and int32 values at pinned addresses ``index`` and ``value``,
    ``ends[t]`` the cumulative count through target ``t``; an index outside its target is
    not written, and counted (:meth:`skipped`). With ``rows_from=(address, stride, count,
    width)`` (a device int32 table, its row stride in elements, rows, elements per row),
    its row ``i`` also goes to row ``words[i] + shift`` of ``rows_to`` (the first ``width``
    elements, at most the table's width): a row index outside the table is not written and
    counts one skipped update. The caller keeps the pinned memory unchanged until the
    launch has run (an event after it).
    """

    GRID = 8  # blocks (grid-stride): a step's rows and changes are a few thousand words at most
    MAX_ROW_GRID = 256  # blocks when copying table rows: one per row, up to this many

    def __init__(self, *, words: int, copy_to: int, targets=(), device: int, skipped: int = 0, rows_to=None):
        if len(targets) > MAX_UPDATE_TARGETS:
            raise ValueError(f"kvcanary: targets: at most {MAX_UPDATE_TARGETS}, got {len(targets)}")
        rt = _runtime()
        self._counter = None
        if not skipped:
            with rt.device(device):
                self._counter = rt.cp.zeros(1, dtype=np.int64)
                rt.cp.cuda.get_current_stream().synchronize()  # zero before any launch, on any stream
            skipped = _ptr(self._counter)
        self._skipped_at = skipped
        v = dict(words=words, copy_to=copy_to, skipped=skipped)
        for t, (ptr, n) in enumerate(targets):
            v[f"target{t}"], v[f"target_len{t}"] = ptr, n
        if rows_to is not None:
            v["rows_to"], v["rows_to_count"], v["rows_to_width"] = rows_to
        self._launch = _Launch(UPDATE_FIELDS, rt.function("scatter", "kvc::apply_updates", device), device, v,
                               self.GRID)
        # Called every step: the argument words are set through a memoryview (a fraction of
        # NumPy's per-item cost) at indices looked up once.
        self._words = memoryview(self._launch.buf)
        at = self._launch.index
        self._scalars = tuple(at[f] for f in ("copy_words", "shift", "index", "value", "count"))
        self._ends = tuple(at[f"end{t}"] for t in range(MAX_UPDATE_TARGETS))
        self._rows = tuple(at[f] for f in ("rows_from", "rows_from_stride", "row_count", "row_width"))
        self._rows_to = rows_to is not None

    def __call__(self, *, copy_words: int, stream: int, shift: int = 0, index: int = 0, value: int = 0,
                 ends=(), rows_from=None) -> None:
        words = self._words
        n = min(len(ends), MAX_UPDATE_TARGETS)
        count = ends[n - 1] if n else 0
        for i, x in zip(self._scalars, (copy_words, shift, index, value, count)):
            words[i] = x
        for t, i in enumerate(self._ends):
            words[i] = ends[t] if t < len(ends) else count
        grid = self.GRID
        if rows_from is None:
            words[self._rows[0]] = 0
        else:
            if not self._rows_to:
                raise ValueError("kvcanary: rows_from: this launcher was made without rows_to")
            for i, x in zip(self._rows, rows_from):
                words[i] = x
            grid = max(grid, min(int(rows_from[2]), self.MAX_ROW_GRID))
        self._launch.grid = grid
        self._launch(stream)

    def skipped(self) -> int:
        """Updates not applied so far (an index outside its target), counted on the device:
        this launcher's, or all those sharing its counter (synchronizes the device)."""
        out = np.zeros(1, dtype=np.int64)
        rt = _runtime()
        with rt.device(self._launch.dev):
            rt.cp.cuda.runtime.deviceSynchronize()
            rt.cp.cuda.runtime.memcpy(out.ctypes.data, self._skipped_at, 8, rt.cp.cuda.runtime.memcpyDeviceToHost)
        return int(out[0])


# --- tensor-parallel agreement ----------------------------------------------------
def _digest_values(rows, *, out, carry, dev: int, stream: int) -> tuple[dict, tuple]:
    """(DIGEST_FIELDS values, device memory they point at) of a digest: uploads the row
    descriptors and zeroes the launch state on ``stream``."""
    rt = _runtime()
    descs = None
    if rows:
        host = np.array([(_ptr(data), data.shape[0], _ptr(count) if count is not None else 0,
                          _ptr(gate) if gate is not None else 0, data.itemsize, _i64(salt))
                         for data, count, gate, salt in rows], dtype=np.int64).reshape(-1, fmt.DIGEST_DESC_WORDS)
        descs = rt.upload_i64(host, dev, stream)
    state = rt.empty_i64(DIGEST_STATE_WORDS, dev)
    rt.zero_async(_ptr(state), 8 * DIGEST_STATE_WORDS, stream)
    v = dict(descs=_ptr(descs) if descs is not None else 0, num_descs=len(rows), out=_ptr(out), state=_ptr(state),
             carry=_ptr(carry) if carry is not None else 0, carry_words=carry.shape[0] if carry is not None else 0)
    return v, (descs, state)


def prepare_digest(rows, *, out, carry, stream=None) -> _Launch:
    """See :class:`kvcanary_cupy.digest.Digest`; views already validated. Uploads the row
    descriptors and zeroes the launch state on ``stream``: prepare before a graph capture."""
    rt = _runtime()
    dev = _dev(out)
    v, owned = _digest_values(rows, out=out, carry=carry, dev=dev, stream=_stream(stream))
    fn = rt.function("digest", "kvc::digest_rows", dev)
    elements = sum(int(r[0].shape[0]) for r in rows)
    # At most a block per SM: each block ends with two atomics on one address, and a
    # step's few hundred thousand elements keep that many blocks busy for a microsecond.
    launch = _OwningLaunch(DIGEST_FIELDS, fn, dev, v, _blocks(max(elements, 1), rt.sm_count(dev)))
    launch.owned = owned
    return launch


def prepare_agree(gathered, *, rank, state, log, tag, stream=None) -> _Launch:
    """See :class:`kvcanary_cupy.digest.RankCompare`; views already validated. One block."""
    dev = _dev(gathered)
    v = dict(gathered=_ptr(gathered), world=gathered.shape[0], words=gathered.shape[1], rank=rank, state=_ptr(state),
             ring=_aligned16(log.ring, "log.ring"), head=_ptr(log.head), ring_capacity=log.capacity, tag=_i64(tag))
    return _Launch(AGREE_FIELDS, _runtime().function("digest", "kvc::compare_digests", dev), dev, v, 1)
