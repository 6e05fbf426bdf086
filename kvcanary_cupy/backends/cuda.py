"""The CUDA backend: the kernels of ``kernels_cu/``, compiled by CuPy (NVRTC).

Same interface as :mod:`kvcanary_cupy.backends.reference`; ops.py calls it with
already-validated CuPy views and a raw ``cudaStream_t``.

Host cost. Each kernel takes one argument, a struct of 8-byte fields (see the
``*Args`` structs in the ``.cu`` files; ``*_FIELDS`` below mirror them and a
test keeps both equal). The struct lives in a NumPy buffer that is packed once
per long-lived combination of buffers (canary, plan, log, sources, tag) and
launched with ``cuLaunchKernel`` directly: a verify call costs a dict lookup
and one driver call; plan, write and scatter first patch the fields that come
from per-step inputs (pointers, lengths, widths). The driver copies the
arguments at launch, so the buffer may be patched again right after.

Graphs. Grids derive from shapes only (capacity, max_batch, batch size, input
lengths, resident blocks), never from data, and nothing here allocates,
synchronizes or reads the device on the hot path. First calls do a little once:
the first plan on a device allocates a chunk of launch states (256 bytes per
plan, zeroed on the op's stream); the first call with a new set of real-KV sources uploads their
fold descriptors; the first launch of a kernel family compiles (or loads from
CuPy's cache) its module. Make those first calls before a graph capture.

Lifetimes. A prepared launch (and its fold descriptors) is kept while every object
it points into lives (canary, plans, log, sources, sampler), and dropped when any of
them is collected; the cache never keeps one alive (see ``_launches``).
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
    "vp_input_errors", "vp_overflows", "vp_max_requested", "vp_capacity", "vp_max_batch",
    "wp_offsets", "wp_seeds", "wp_num_rows", "wp_input_errors", "wp_max_batch", "sync",
)
PLAN_STEP_FIELDS = 17  # the leading fields come from the step's inputs
WRITE_FIELDS = (
    "records", "num_slots", "offsets", "seeds", "num_rows", "position_check", "max_batch",
    "input_ids", "positions", "out_cache_loc", "exp_tokens", "exp_positions", "widths", "avail",
    "ring", "head", "ring_capacity", "counters", "tag", "folds", "num_folds",
)
WRITE_STEP = ("input_ids", "positions", "out_cache_loc", "exp_tokens", "exp_positions", "widths", "avail")
_W0 = WRITE_FIELDS.index(WRITE_STEP[0])
assert WRITE_FIELDS[_W0:_W0 + len(WRITE_STEP)] == WRITE_STEP
VERIFY_FIELDS = (
    "records", "num_slots", "slot_indices", "prev_slot_indices", "expected_positions", "expected_tokens",
    "offsets", "offsets_len", "num_valid", "enable", "capacity", "ring", "head", "ring_capacity", "counters",
    "tag", "check_tokens", "folds", "num_folds", "sample_state", "period",
)
SCATTER_FIELDS = ("table", "nreq", "width", "tokens", "ntok", "offsets", "req_pool_indices", "bs", "widths")
HAS_ETOK, HAS_EPOS = 1 << 5, 1 << 6  # write.cu widths bits


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

    def empty_u64(self, n: int, dev: int):
        with self.cp.cuda.Device(dev):
            return self.cp.empty(n, dtype=np.uint64)

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
    """Kernels launched in order with one packed argument struct (every op is one kernel now)."""

    __slots__ = ("fns", "buf", "params", "params_ptr", "dev", "grids", "lock", "index", "keep", "packed",
                 "__weakref__")

    def __init__(self, fields, fns, dev, values: dict, keep=None):
        self.index = {f: i for i, f in enumerate(fields)}
        self.buf = np.zeros(len(fields), dtype=np.int64)
        for k, v in values.items():
            self.buf[self.index[k]] = v
        # cuLaunchKernel's kernelParams: one pointer, to the struct.
        self.params = np.array([self.buf.ctypes.data], dtype=np.uint64)
        self.params_ptr = int(self.params.ctypes.data)  # .ctypes costs a microsecond: read it once
        self.fns = fns
        self.dev = dev
        self.grids = None
        self.lock = threading.Lock()
        self.keep = keep  # device arrays the packed pointers point into, owned by this launch
        self.packed = None  # the step fields now in buf (see _Launch.run_step)

    def run_step(self, lo: int, step: np.ndarray, grids, stream: int) -> None:
        """Launch with ``step`` in ``buf[lo:lo + len(step)]``, repacking only when another
        step was packed since (the same bound call again costs no copy)."""
        with self.lock:
            if self.packed is not step:
                self.buf[lo:lo + step.shape[0]] = step
                self.packed = step
            self.run(grids, stream)

    def run(self, grids, stream: int) -> None:
        rt = _rt
        params = self.params_ptr
        if rt.current_device() != self.dev:
            with rt.device(self.dev):
                for fn, g in zip(self.fns, grids):
                    rt.launch_kernel(fn, g, 1, 1, BLOCK, 1, 1, 0, stream, params, 0)
            return
        for fn, g in zip(self.fns, grids):
            rt.launch_kernel(fn, g, 1, 1, BLOCK, 1, 1, 0, stream, params, 0)


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


# Prepared launches, per owner (the canary, or a plan) and per combination of the other
# objects whose buffers a launch points at (plans, log, real-KV sources, sampler).
#
# An entry lives while its owner and every one of those objects live, and no longer:
# its key holds their ids, never the objects, and a finalizer on each drops the entry
# (with its fold table) as soon as any of them is collected. Holding them would keep
# every KV pool ever passed alive, and a JAX engine passes a new pool array each step.
# Dropping is safe for captured CUDA graphs: a graph that captured a launch also
# captured the addresses of those objects' buffers (the pool's among them), so it
# cannot meaningfully outlive them; keep the objects a graph uses, as any buffer a
# graph reads. An id cannot be reused while its entry exists: the finalizer runs when
# the object dies, before its memory (and id) can go to another object.
_launches: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class _Entry:
    __slots__ = ("launch", "finalizers", "pinned")

    def __init__(self, launch, finalizers, pinned):
        self.launch = launch
        self.finalizers = finalizers
        self.pinned = pinned  # objects that take no weak reference: held, as before


def _drop(per_ref, key) -> None:
    """A watched object of entry ``key`` died: forget the entry and its other watches."""
    per = per_ref()
    e = per.entries.pop(key, None) if per is not None else None
    if e is not None:
        for f in e.finalizers:
            f.detach()


class _PerOwner:
    """The entries of one owner. When the owner dies, so do the watches of its entries,
    so a long-lived object (a log) does not collect finalizers of dead canaries."""

    __slots__ = ("entries", "__weakref__")

    def __init__(self):
        self.entries: dict = {}

    @staticmethod
    def release(entries: dict) -> None:
        for e in entries.values():
            for f in e.finalizers:
                f.detach()
        entries.clear()


def _cached(owner, objects: tuple, scalars: tuple, make) -> _Launch:
    """The launch of ``owner`` for ``objects`` (compared by identity) and ``scalars``
    (by value), made by ``make()`` on first use."""
    per = _launches.get(owner)
    if per is None:
        per = _launches[owner] = _PerOwner()
        weakref.finalize(owner, _PerOwner.release, per.entries).atexit = False
    key = (tuple(map(id, objects)), scalars)
    e = per.entries.get(key)
    if e is None:
        L = make()
        finalizers, pinned, per_ref = [], [], weakref.ref(per)
        for o in {id(o): o for o in objects if o is not None and o is not owner}.values():
            try:
                finalizers.append(weakref.finalize(o, _drop, per_ref, key))
            except TypeError:
                pinned.append(o)
        for f in finalizers:
            f.atexit = False  # nothing to release at exit
        e = per.entries[key] = _Entry(L, finalizers, pinned)
    return e.launch


# --- real-KV fold descriptors -------------------------------------------------
def _fold_table(sources, mode, dev: int, stream: int):
    """(device array [F, 4] or None, F): one row per (source, layer): base address,
    bytes per token, 16-byte chunks hashed. Owned by the launch that uses it."""
    if mode == RealKvMode.NONE or not sources:
        return None, 0
    rows = []
    for src in sources:
        eff = fmt.KV_CHUNK_BYTES if mode == RealKvMode.PARTIAL else src.read_bytes
        base = _ptr(src.data)
        for layer in range(src.num_layers):
            rows.append((base + layer * src.layer_bytes, src.bytes_per_token, eff // fmt.KV_CHUNK_BYTES, 0))
    host = np.array(rows, dtype=np.int64).reshape(-1, 4)
    return _runtime().upload_i64(host, dev, stream), host.shape[0]


# --- plan --------------------------------------------------------------------
PLAN_SYNC_WORDS = 32  # plan.cu SYNC_WORDS: plan_step's launch state (256 bytes)
_sync_states: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # plan -> (chunk array, index)
_sync_chunks: dict = {}  # device -> [chunk array, next free index]
_STATES_PER_CHUNK = 256


def _sync_state(owner, dev: int, stream: int) -> int:
    """The address of the plan's launch state (PLAN_SYNC_WORDS int64). States come
    from a per-device chunk allocated once per 256 plans; a new state is zeroed on
    the op's stream, so it is 0 when the plan's first launch runs (and stays 0
    between launches: the last block out resets it)."""
    t = _sync_states.get(owner)
    if t is None:
        chunk = _sync_chunks.get(dev)
        if chunk is None or chunk[1] == _STATES_PER_CHUNK:
            chunk = _sync_chunks[dev] = [_runtime().empty_i64(_STATES_PER_CHUNK * PLAN_SYNC_WORDS, dev), 0]
        t = _sync_states[owner] = (chunk[0], chunk[1] * PLAN_SYNC_WORDS)
        chunk[1] += 1
        _runtime().zero_async(_ptr(t[0]) + 8 * t[1], 8 * PLAN_SYNC_WORDS, stream)
    return _ptr(t[0]) + 8 * t[1]


def _plan_launch(vp, wp, stream: int) -> _Launch:
    owner, other = (vp, wp) if vp is not None else (wp, None)
    return _cached(owner, (other,), ("plan",), lambda: _make_plan_launch(vp, wp, owner, stream))


def _make_plan_launch(vp, wp, owner, stream: int) -> _Launch:
    rt = _runtime()
    dev = _dev(owner.offsets)
    v = {"sync": _sync_state(owner, dev, stream)}
    if vp is not None:
        v.update(vp_slot=_ptr(vp.slot_indices), vp_prev=_ptr(vp.prev_slot_indices),
                 vp_epos=_ptr(vp.expected_positions), vp_etok=_ptr(vp.expected_tokens),
                 vp_offsets=_ptr(vp.offsets), vp_num_valid=_ptr(vp.num_valid), vp_enable=_ptr(vp.enable),
                 vp_requested=_ptr(vp.requested), vp_input_errors=_ptr(vp.input_errors),
                 vp_overflows=_ptr(vp.overflows), vp_max_requested=_ptr(vp.max_requested),
                 vp_capacity=vp.capacity, vp_max_batch=vp.max_batch)
    if wp is not None:
        v.update(wp_offsets=_ptr(wp.offsets), wp_seeds=_ptr(wp.seed_slots), wp_num_rows=_ptr(wp.num_rows),
                 wp_input_errors=_ptr(wp.input_errors), wp_max_batch=wp.max_batch)
    fn = rt.function("plan", "kvc::plan_step", dev)
    L = _Launch(PLAN_FIELDS, [fn], dev, v)
    L.grids = (rt.resident_blocks(fn, dev), vp.capacity if vp is not None else 0)
    return L


def bind_plan(vp, wp, *, req_pool_indices, prefix_lens, extend_lens, table, page_size, swa, expected):
    """Pack one plan call once; returns ``run(stream)``, which launches it. ops keeps the
    bound call while the caller passes the same arrays, so a step pays only the launch."""
    bs = req_pool_indices.shape[0]
    widths = (_wide(req_pool_indices) | _wide(prefix_lens) << 1 | _wide(extend_lens) << 2 | _wide(table) << 3)
    if swa is not None:
        lut = swa.lut
        lut_ptr, lut_len, swa_size = _ptr(lut), lut.shape[0], swa.size
        widths |= _wide(lut) << 4
    else:
        lut_ptr, lut_len, swa_size = 0, -1, 0
    if expected is not None:
        et, evl = expected.table, expected.valid_lens
        e_vals = (_ptr(et), _ptr(evl))
        erows, ewidth, eoff = et.shape[0], et.shape[1], expected.offset
        widths |= _wide(et) << 5 | _wide(evl) << 6
    else:
        e_vals, erows, ewidth, eoff = (0, 0), -1, 0, 0
    step = np.array((_ptr(req_pool_indices), _ptr(prefix_lens), _ptr(extend_lens), _ptr(table), lut_ptr) + e_vals + (
        widths, bs, table.shape[0], table.shape[1], page_size, lut_len, swa_size, erows, ewidth, eoff), np.int64)
    bound = []  # [launch, grids], filled on the first run (it needs the stream)

    def run(stream=None):
        if stream is None:
            stream = _runtime().default_stream()
        if not bound:
            L = _plan_launch(vp, wp, stream)
            resident, cap = L.grids  # a block per batch row, a thread per entry, one wave at most
            bound[:] = [L, (_blocks(max(bs * BLOCK, cap), resident),)]
        bound[0].run_step(0, step, bound[1], stream)

    return run


def plan(vp, wp, *, stream=None, **inputs):
    """See :func:`kvcanary_cupy.ops.plan`; views already validated."""
    bind_plan(vp, wp, **inputs)(stream)


# --- write -------------------------------------------------------------------
def _canary_launch(fields, family, names, canary, log, tag, sources, mode, stream: int, **values) -> _Launch:
    """A write or verify launch: the kernel instance ``names[1]`` with real-KV folds, else
    ``names[0]``, and the canary, log, tag and fold fields both structs share, plus ``values``."""
    dev = _dev(canary.records)
    folds, nf = _fold_table(sources, mode, dev, stream)
    fn = _runtime().function(family, names[1] if nf else names[0], dev)
    return _Launch(fields, [fn], dev, dict(
        values, records=_aligned16(canary.records, "canary.records"), num_slots=canary.num_slots,
        ring=_aligned16(log.ring, "log.ring"), head=_ptr(log.head), ring_capacity=log.capacity,
        counters=_ptr(log.counter_array), tag=_i64(tag), folds=_ptr(folds) if nf else 0, num_folds=nf),
        keep=folds)


def _make_write_launch(canary, wp, log, tag, sources, mode, stream: int) -> _Launch:
    L = _canary_launch(WRITE_FIELDS, "write", ("kvc::write_tokens<false>", "kvc::write_tokens<true>"), canary, log,
                       tag, sources, mode, stream, offsets=_ptr(wp.offsets), seeds=_ptr(wp.seed_slots),
                       num_rows=_ptr(wp.num_rows), position_check=_ptr(wp.position_check), max_batch=wp.max_batch)
    nf = int(L.buf[L.index["num_folds"]])
    L.grids = (_runtime().resident_blocks(L.fns[0], L.dev), wp.max_batch * 32, min(nf, 32))
    return L


def bind_write(canary, wp, *, input_ids, positions, out_cache_loc, log, tag, sources, mode, expected_tokens,
               expected_positions):
    """Pack one write call once; returns ``run(stream)`` (see :func:`bind_plan`)."""
    avail = min(input_ids.shape[0], positions.shape[0], out_cache_loc.shape[0])
    widths = input_ids.itemsize >> 3 | (positions.itemsize >> 3) << 1 | (out_cache_loc.itemsize >> 3) << 2
    et_ptr = ep_ptr = 0
    if expected_tokens is not None:
        avail = min(avail, expected_tokens.shape[0])
        widths |= (expected_tokens.itemsize >> 3) << 3 | HAS_ETOK
        et_ptr = _ptr(expected_tokens)
    if expected_positions is not None:
        avail = min(avail, expected_positions.shape[0])
        widths |= (expected_positions.itemsize >> 3) << 4 | HAS_EPOS
        ep_ptr = _ptr(expected_positions)
    step = np.array((_ptr(input_ids), _ptr(positions), _ptr(out_cache_loc), et_ptr, ep_ptr, widths, avail), np.int64)
    bound = []

    def run(stream=None):
        if stream is None:
            stream = _runtime().default_stream()
        if not bound:
            L = _cached(canary, (wp, log, *sources), ("write", mode, tag),
                        lambda: _make_write_launch(canary, wp, log, tag, sources, mode, stream))
            resident, row_threads, lanes = L.grids
            bound[:] = [L, (_blocks(max(row_threads, avail * lanes), resident),)]
        bound[0].run_step(_W0, step, bound[1], stream)

    return run


def write(canary, wp, *, stream=None, **inputs):
    """See :func:`kvcanary_cupy.ops.write`; views already validated."""
    bind_write(canary, wp, **inputs)(stream)


# --- verify ------------------------------------------------------------------
def _make_verify_launch(canary, vp, log, tag, sources, mode, check_tokens, sample, stream: int) -> _Launch:
    L = _canary_launch(VERIFY_FIELDS, "verify", ("kvc::verify_entries<false>", "kvc::verify_entries<true>"), canary,
                       log, tag, sources, mode, stream, slot_indices=_ptr(vp.slot_indices),
                       prev_slot_indices=_ptr(vp.prev_slot_indices), expected_positions=_ptr(vp.expected_positions),
                       expected_tokens=_ptr(vp.expected_tokens), offsets=_ptr(vp.offsets),
                       offsets_len=vp.offsets.shape[0], num_valid=_ptr(vp.num_valid), enable=_ptr(vp.enable),
                       capacity=vp.capacity, check_tokens=1 if check_tokens else 0,
                       sample_state=_ptr(sample.state) if sample is not None else 0,
                       period=sample.period if sample is not None else 1)
    nf = int(L.buf[L.index["num_folds"]])
    L.grids = (_blocks(vp.capacity * (min(nf, 32) if nf else 1), _runtime().resident_blocks(L.fns[0], L.dev)),)
    return L


def bind_verify(canary, vp, *, log, tag, sources, mode, check_tokens, sample):
    """Returns ``run(stream)`` for one verify call (see :func:`bind_plan`)."""
    bound = []

    def run(stream=None):
        if stream is None:
            stream = _runtime().default_stream()
        if not bound:
            bound.append(_cached(canary, (vp, log, sample, *sources), ("verify", mode, tag, check_tokens),
                                 lambda: _make_verify_launch(canary, vp, log, tag, sources, mode, check_tokens,
                                                             sample, stream)))
        L = bound[0]
        L.run(L.grids, stream)

    return run


def verify(canary, vp, *, stream=None, **inputs):
    """See :func:`kvcanary_cupy.ops.verify`; views already validated."""
    bind_verify(canary, vp, **inputs)(stream)


# --- scatter_expected_tokens ---------------------------------------------------
_scatters: dict = {}


def scatter_expected_tokens(table, *, tokens, offsets, req_pool_indices, stream=None):
    """See :func:`kvcanary_cupy.ops.scatter_expected_tokens`; views already validated."""
    rt = _runtime()
    if stream is None:
        stream = rt.default_stream()
    dev = _dev(table)
    L = _scatters.get(dev)
    if L is None:
        L = _scatters[dev] = _Launch(SCATTER_FIELDS, [rt.function("scatter", "kvc::scatter_expected_tokens", dev)],
                                     dev, {})
        L.grids = rt.sm_count(dev)
    bs = req_pool_indices.shape[0]
    widths = _wide(table) | _wide(tokens) << 1 | _wide(offsets) << 2 | _wide(req_pool_indices) << 3
    grid = max(1, min(bs, L.grids * 4))
    with L.lock:
        L.buf[:] = (_ptr(table), table.shape[0], table.shape[1], _ptr(tokens), tokens.shape[0], _ptr(offsets),
                    _ptr(req_pool_indices), bs, widths)
        L.run((grid,), stream)


# --- fingerprints (a helper, not an op) ----------------------------------------
def fingerprints(sources, mode, slots):
    """Real-KV fingerprints (uint64 ``[n]``, a CuPy array) of in-range ``slots``
    (int64 CuPy ``[n]``), computed on the device on CuPy's current stream."""
    rt = _runtime()
    dev = _dev(slots)
    n = int(slots.shape[0])
    out = rt.empty_u64(n, dev)
    stream = rt.default_stream()
    folds, nf = _fold_table(tuple(sources), RealKvMode(mode), dev, stream)
    if nf == 0 or n == 0:
        out.fill(0)
        return out
    slots64 = slots.astype(np.int64, copy=False)
    vals = np.array([_ptr(folds), nf, _ptr(slots64), n, _ptr(out)], dtype=np.int64)
    params = np.array([vals.ctypes.data + 8 * i for i in range(5)], dtype=np.uint64)
    fn = rt.function("verify", "kvc::fingerprint_slots", dev)
    grid = _blocks(n * min(nf, 32), rt.resident_blocks(fn, dev))
    with rt.device(dev):
        rt.launch_kernel(fn, grid, 1, 1, BLOCK, 1, 1, 0, stream,
                         int(params.ctypes.data), 0)
    return out
