"""What the bench measures: the workloads (cases) and the pools they run on.

Pure data: nothing here touches a device, so the case list, its sizes and its
memory needs can be checked anywhere.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

TEN_MILLION = 10_000_000
MB = 1 << 20
GIB = 1 << 30
MILLION_ENTRIES = 1 << 20  # the decode b256 p4096 step
SCAN, SGLANG = "scan", "sglang"  # the canary's chain kinds (kvcanary_cupy.format.CHAINS)
# The ops a case with a prefix times: the fused op beside plan and verify, so both ways of
# running a step's checks are visible; write last, so every verify reads untouched prefixes.
STEP_OPS = ("plan", "verify", "plan_and_verify", "write")
SGLANG_BATCHES = (1, 64, 256, 1024, 4096)  # decode batches of SGLang's figures, all at prefix 4096
SGLANG_PREFIX = 4096


@dataclass(frozen=True)
class Pool:
    """One canary buffer (and optionally one real-KV source) that a group of cases shares.

    Attributes:
        name: key the cases refer to.
        min_slots: the pool holds at least this many slots; slots are drawn at
            random from ``[1, max(min_slots, 1.25 * slots a case needs))``.
        kv_layers: 0 for no real-KV source, else the source's layer count
            (1: a plain source, > 1: a layer axis).
        bytes_per_token: bytes of one slot in one layer of the source.
    """

    name: str
    min_slots: int
    kv_layers: int = 0
    bytes_per_token: int = 256

    @property
    def kv_bytes_per_slot(self) -> int:
        return self.kv_layers * self.bytes_per_token


@dataclass(frozen=True)
class Case:
    """One workload: a batch of rows, each with ``prefix`` cached tokens and ``extend`` new ones.

    Attributes:
        name: unique label used in the tables.
        group: ``decode``, ``prefill``, ``swa``, ``real_kv``, ``write_row`` or ``monitor``
            (a whole monitor step, ``KvCanary.before_forward`` + ``after_forward``).
        batch, prefix, extend: rows, cached tokens per row, tokens written per row.
        window: SWA window length (None: no window).
        pool: the :class:`Pool` name the case runs on.
        mode: real-KV mode name, ``NONE`` / ``PARTIAL`` / ``ALL``.
        ops: which ops are timed (for a monitor case ``step``, and ``stamped``: the same step
            of a monitor that stamps before the forward, where the case keeps no real-KV
            fingerprints).
        baseline: whether the PyTorch baseline is timed beside it.
        chain: the canary's chain kind, ``scan`` (the default) or ``sglang``.
        check_tokens: a monitor case checks every verified record's token against a
            bound expected-token table.
    """

    name: str
    group: str
    batch: int
    prefix: int
    extend: int
    window: int | None = None
    pool: str = "main"
    mode: str = "NONE"
    ops: tuple = STEP_OPS
    baseline: bool = True
    chain: str = SCAN
    check_tokens: bool = False

    @property
    def width(self) -> int:
        """Positions per table row: the prefix and the tokens this step writes."""
        return self.prefix + self.extend

    @property
    def window_len(self) -> int:
        """Prefix positions verified per row."""
        return self.prefix if self.window is None else min(self.prefix, self.window)

    @property
    def entries(self) -> int:
        """Verify-plan entries of one step."""
        return self.batch * self.window_len

    @property
    def head_reads(self) -> int:
        """Rows whose window starts past position 0: each reads one extra (predecessor) slot."""
        return self.batch if self.window is not None and self.prefix > self.window else 0

    @property
    def tokens(self) -> int:
        """Tokens the step writes."""
        return self.batch * self.extend

    @property
    def seeded_rows(self) -> int:
        """Rows whose chain continues from a cached record (prefix > 0)."""
        return self.batch if self.prefix > 0 and self.extend > 0 else 0

    @property
    def slots(self) -> int:
        """Distinct slots one instance of the case occupies."""
        return self.batch * self.width


@dataclass(frozen=True)
class Suite:
    """Everything one bench run does."""

    name: str
    pools: tuple
    cases: tuple
    copy_bytes: int
    host_case: Case
    host_calls: int
    runs: int
    max_sets: int = 8
    baseline_budget_s: float = 4.0
    op_budget_s: float = 10.0
    soft_deadline_s: float = 390.0  # past this, the baseline is skipped
    hard_deadline_s: float = 450.0  # past this, remaining cases are skipped
    gather_probes: tuple = ()  # (entries, pool slots, bytes per slot) for the gather probe
    monitor_host_batch: int = 64  # the monitor step whose host time (eager, graph replay) is measured
    notes: tuple = field(default_factory=tuple)

    def pool(self, name: str) -> Pool:
        for p in self.pools:
            if p.name == name:
                return p
        raise KeyError(f"kvcanary: bench: no pool named {name!r}")


def _decode(batch, prefix, **kw):
    return Case(f"decode b{batch} p{prefix}", "decode", batch, prefix, 1, **kw)


SERIAL_BASELINE_MAX = 2048  # longest row the baseline's serial v1 chain runs (about 1 s a call in torch)


def _prefill(batch, extend, chain=SCAN):
    """A prefill from an empty prefix. The v1 chain's variant times only the write (plan does
    not depend on the chain), and its baseline, a Python loop over tokens, only on short rows:
    there it checks the v1 records on the device byte for byte at a bearable cost."""
    if chain == SCAN:
        return Case(f"prefill b{batch} e{extend}", "prefill", batch, 0, extend, ops=("plan", "write"))
    return Case(f"prefill b{batch} e{extend} {chain}", "prefill", batch, 0, extend, ops=("write",),
                baseline=extend <= SERIAL_BASELINE_MAX, chain=chain)


def _write_rows(pool, label, extend):
    """One row of ``extend`` new tokens, real-KV ALL and NONE, on both chain kinds."""
    return [Case(f"write row {label} {mode} e{extend}" + ("" if chain == SCAN else f" {chain}"), "write_row", 1, 0,
                 extend, pool=pool, mode=mode, ops=("write",), baseline=False, chain=chain)
            for chain in (SCAN, SGLANG) for mode in ("ALL", "NONE")]


def _monitor(batch, prefix, mode="NONE", check_tokens=False):
    """A decode step of the monitor (one new token per row)."""
    label = mode + ("+tokens" if check_tokens else "")
    ops = ("step", "stamped") if mode == "NONE" else ("step",)
    return Case(f"monitor b{batch} p{prefix} {label}", "monitor", batch, prefix, 1, pool="monitor", mode=mode,
                ops=ops, baseline=False, check_tokens=check_tokens)


def _monitors(batches, prefix):
    """Configured as SGLang's figures (real-KV NONE, no token check), then with real-KV
    PARTIAL and the token check on."""
    return ([_monitor(b, prefix) for b in batches]
            + [_monitor(b, prefix, "PARTIAL", check_tokens=True) for b in batches])


def full_suite(runs: int = 50) -> Suite:
    """The full measurement: one H200, one command, a few minutes."""
    cases = [_decode(b, p) for b in (1, 64, 256, 1024) for p in (512, 4096, 16384)]
    cases.append(_decode(4096, SGLANG_PREFIX))
    cases += [_prefill(b, e, chain) for chain in (SCAN, SGLANG) for b in (1, 32) for e in (2048, 16384)]
    cases.append(Case("swa b256 p16384 w4096", "swa", 256, 16384, 1, window=4096))
    for pool, label in (("kv1", "1x256B"), ("kv32", "32x256B")):
        for mode in ("NONE", "PARTIAL", "ALL"):
            cases.append(Case(f"real-kv {label} {mode} b256 p4096", "real_kv", 256, 4096, 1, pool=pool, mode=mode))
        cases += _write_rows(pool, label, 16384)
    cases += _monitors(SGLANG_BATCHES, SGLANG_PREFIX)
    pools = (Pool("main", TEN_MILLION),
             # The monitor's own pool: its largest step (4096 rows of 4096 + 1 tokens) draws from
             # about 21M slots; the 256 B/token source is read by the PARTIAL steps only.
             Pool("monitor", TEN_MILLION, kv_layers=1),
             Pool("kv1", TEN_MILLION, kv_layers=1),
             # 32 layers x 256 B over 10M slots would be 82 GB: this pool starts at 2M slots (the draw
             # range of its cases makes it about 2.6M, 21 GB).
             Pool("kv32", 2_000_000, kv_layers=32))
    return Suite(name="full", pools=pools, cases=tuple(cases), copy_bytes=GIB,
                 host_case=_decode(64, 512, pool="host"),
                 host_calls=2000, runs=runs, soft_deadline_s=180.0, hard_deadline_s=240.0,
                 gather_probes=((MILLION_ENTRIES, TEN_MILLION, 32), (4 * MILLION_ENTRIES, TEN_MILLION, 32),
                                (MILLION_ENTRIES, 2_000_000, 256)),
                 notes=("slots are distinct within a case and drawn from at least 10M; the 16M-entry decode cases "
                        "need a 21M-slot pool to keep them distinct",
                        "the 32-layer real-KV pool holds about 2.6M slots (32 x 256 B each, 21 GB): 32 layers over "
                        "10M slots would take 82 GB",
                        "every canary uses the scan chain (format v2) unless its case is named `sglang` (the v1 "
                        "chain, byte for byte SGLang's records)"))


def quick_suite(runs: int = 5) -> Suite:
    """A tiny subset that exercises every code path in seconds (the smoke test)."""
    cases = [_decode(4, 256), _decode(2, 1024)]
    cases += [_prefill(2, 512), _prefill(2, 512, SGLANG)]
    cases.append(Case("swa b4 p1024 w256", "swa", 4, 1024, 1, window=256))
    for pool, label in (("kv1", "1x256B"), ("kv32", "4x256B")):
        for mode in ("NONE", "PARTIAL", "ALL"):
            cases.append(Case(f"real-kv {label} {mode} b4 p256", "real_kv", 4, 256, 1, pool=pool, mode=mode))
        cases += _write_rows(pool, label, 1024)
    cases += _monitors((2, 4), 256)
    pools = (Pool("main", 50_000), Pool("monitor", 20_000, kv_layers=1), Pool("kv1", 50_000, kv_layers=1),
             Pool("kv32", 20_000, kv_layers=4))
    return Suite(name="quick", pools=pools, cases=tuple(cases), copy_bytes=64 * MB,
                 host_case=_decode(8, 128, pool="host"),
                 host_calls=100, runs=runs, max_sets=2, gather_probes=((4096, 50_000, 32),), baseline_budget_s=2.0,
                 op_budget_s=5.0, soft_deadline_s=1e9, hard_deadline_s=1e9, monitor_host_batch=4)


def select(suite: Suite, pattern: str | None) -> Suite:
    """The suite restricted to cases whose name matches the regular expression ``pattern``."""
    if not pattern:
        return suite
    import re  # noqa: PLC0415

    rx = re.compile(pattern)
    return dataclasses.replace(suite, cases=tuple(c for c in suite.cases if rx.search(c.name)))


# --- sizing ------------------------------------------------------------------------
def rotation(set_bytes: int, l2_bytes: int, max_sets: int) -> tuple[int, bool]:
    """How many input sets to rotate through, and whether an L2 flush is still needed.

    Consecutive timed runs must not find their inputs in L2: the sets together
    should exceed twice the L2 size. Where ``max_sets`` sets are not enough (tiny
    cases), the timer also overwrites a scratch buffer of twice L2 between runs,
    outside the timed interval.
    """
    if l2_bytes <= 0:
        return 1, False
    want = 2 * l2_bytes
    if set_bytes >= want:
        return 1, False
    k = min(max_sets, max(1, math.ceil(want / max(set_bytes, 1))))
    return k, k * set_bytes < want


def draw_range(case: Case, sets: int, pool: Pool) -> int:
    """Slots are drawn from ``[1, draw_range]``: the pool's size, or 1.25x what the sets occupy."""
    return max(pool.min_slots, math.ceil(1.25 * sets * case.slots))


def pool_slots(pool: Pool, needs) -> int:
    """Canary size of a pool: one more than the widest draw range of its cases (slot 0 is reserved)."""
    return max([pool.min_slots] + list(needs)) + 1


def set_bytes(case: Case, pool: Pool) -> int:
    """The least bytes one input set of ``case`` moves: its plan, verify and write (a monitor
    case: its step), each counted once."""
    from .floors import case_bytes  # noqa: PLC0415

    b = case_bytes(case, pool)
    return b["step"] if case.group == "monitor" else b["plan"] + b["verify"] + b["write"]


def layout(suite: Suite, pool: Pool, l2_bytes: int) -> tuple[int, dict]:
    """Canary size of ``pool`` and, per case on it, (input sets, L2 flush needed).

    Monitor cases run on one table sized for their largest batch: one set each, and the
    timer flushes L2 before every run."""
    group = [c for c in suite.cases if c.pool == pool.name]
    sets = {c.name: (1, True) if c.group == "monitor" else rotation(set_bytes(c, pool), l2_bytes, suite.max_sets)
            for c in group}
    return pool_slots(pool, [draw_range(c, sets[c.name][0], pool) for c in group]), sets


def _case_device_bytes(case: Case, sets: int, pool_slots_: int) -> int:
    """Inputs and plans of ``sets`` sets of a case; a monitor case's expected-token table and
    the gather probe of its records besides."""
    b = sets * (case.slots * 4 + case.entries * 32 + case.tokens * 24)
    if case.group == "monitor":
        b += case.slots * 8 + pool_slots_ * 32
    return b


def device_bytes(suite: Suite, pool: Pool, l2_bytes: int) -> int:
    """Rough device memory a pool's phase holds at its peak: a canary per chain kind, KV, LUT
    and the largest case's inputs and plans (its sets together)."""
    n, sets = layout(suite, pool, l2_bytes)
    group = [c for c in suite.cases if c.pool == pool.name]
    fixed = n * 32 * len({c.chain for c in group} or {SCAN}) + n * pool.kv_bytes_per_slot
    if any(c.window for c in group):
        fixed += n * 4
    return fixed + max((_case_device_bytes(c, sets[c.name][0], n) for c in group), default=0)
