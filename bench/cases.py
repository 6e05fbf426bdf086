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
        group: ``decode``, ``prefill``, ``swa``, ``real_kv`` or ``write_row``.
        batch, prefix, extend: rows, cached tokens per row, tokens written per row.
        window: SWA window length (None: no window).
        pool: the :class:`Pool` name the case runs on.
        mode: real-KV mode name, ``NONE`` / ``PARTIAL`` / ``ALL``.
        ops: which ops are timed.
        baseline: whether the PyTorch baseline is timed beside it.
    """

    name: str
    group: str
    batch: int
    prefix: int
    extend: int
    window: int | None = None
    pool: str = "main"
    mode: str = "NONE"
    ops: tuple = ("plan", "verify", "write")
    baseline: bool = True

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
    notes: tuple = field(default_factory=tuple)

    def pool(self, name: str) -> Pool:
        for p in self.pools:
            if p.name == name:
                return p
        raise KeyError(f"kvcanary: bench: no pool named {name!r}")


def _decode(batch, prefix, **kw):
    return Case(f"decode b{batch} p{prefix}", "decode", batch, prefix, 1, **kw)


def full_suite(runs: int = 50) -> Suite:
    """The full measurement: one H200, one command, a few minutes."""
    cases = [_decode(b, p) for b in (1, 64, 256, 1024) for p in (512, 4096, 16384)]
    cases += [Case(f"prefill b{b} e{e}", "prefill", b, 0, e, ops=("plan", "write")) for b in (1, 32)
              for e in (2048, 16384)]
    cases.append(Case("swa b256 p16384 w4096", "swa", 256, 16384, 1, window=4096))
    for pool, label in (("kv1", "1x256B"), ("kv32", "32x256B")):
        for mode in ("NONE", "PARTIAL", "ALL"):
            cases.append(Case(f"real-kv {label} {mode} b256 p4096", "real_kv", 256, 4096, 1, pool=pool, mode=mode))
        for mode in ("ALL", "NONE"):
            cases.append(Case(f"write row {label} {mode} e16384", "write_row", 1, 0, 16384, pool=pool, mode=mode,
                              ops=("write",), baseline=False))
    pools = (Pool("main", TEN_MILLION), Pool("kv1", TEN_MILLION, kv_layers=1),
             # 32 layers x 256 B over 10M slots would be 82 GB: this pool starts at 2M slots (the draw
             # range of its cases makes it about 2.6M, 21 GB).
             Pool("kv32", 2_000_000, kv_layers=32))
    return Suite(name="full", pools=pools, cases=tuple(cases), copy_bytes=GIB,
                 host_case=_decode(64, 512, pool="host"),
                 host_calls=2000, runs=runs,
                 gather_probes=((MILLION_ENTRIES, TEN_MILLION, 32), (4 * MILLION_ENTRIES, TEN_MILLION, 32),
                                (MILLION_ENTRIES, 2_000_000, 256)),
                 notes=("slots are distinct within a case and drawn from at least 10M; the 16M-entry decode case "
                        "needs a 21M-slot pool to keep them distinct",
                        "the 32-layer real-KV pool holds about 2.6M slots (32 x 256 B each, 21 GB): 32 layers over "
                        "10M slots would take 82 GB"))


def quick_suite(runs: int = 5) -> Suite:
    """A tiny subset that exercises every code path in seconds (the smoke test)."""
    cases = [_decode(4, 256), _decode(2, 1024)]
    cases.append(Case("prefill b2 e512", "prefill", 2, 0, 512, ops=("plan", "write")))
    cases.append(Case("swa b4 p1024 w256", "swa", 4, 1024, 1, window=256))
    for pool, label in (("kv1", "1x256B"), ("kv32", "4x256B")):
        for mode in ("NONE", "PARTIAL", "ALL"):
            cases.append(Case(f"real-kv {label} {mode} b4 p256", "real_kv", 4, 256, 1, pool=pool, mode=mode))
        for mode in ("ALL", "NONE"):
            cases.append(Case(f"write row {label} {mode} e1024", "write_row", 1, 0, 1024, pool=pool, mode=mode,
                              ops=("write",), baseline=False))
    pools = (Pool("main", 50_000), Pool("kv1", 50_000, kv_layers=1), Pool("kv32", 20_000, kv_layers=4))
    return Suite(name="quick", pools=pools, cases=tuple(cases), copy_bytes=64 * MB,
                 host_case=_decode(8, 128, pool="host"),
                 host_calls=100, runs=runs, max_sets=2, gather_probes=((4096, 50_000, 32),), baseline_budget_s=2.0, op_budget_s=5.0,
                 soft_deadline_s=1e9, hard_deadline_s=1e9)


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


def layout(suite: Suite, pool: Pool, l2_bytes: int) -> tuple[int, dict]:
    """Canary size of ``pool`` and, per case on it, (input sets, L2 flush needed)."""
    from .floors import case_bytes  # noqa: PLC0415

    group = [c for c in suite.cases if c.pool == pool.name]
    sets = {c.name: rotation(sum(case_bytes(c, pool).values()), l2_bytes, suite.max_sets) for c in group}
    return pool_slots(pool, [draw_range(c, sets[c.name][0], pool) for c in group]), sets


def device_bytes(suite: Suite, pool: Pool, l2_bytes: int) -> int:
    """Rough device memory a pool's phase holds at its peak: canary, KV, LUT and the
    largest case's inputs and plans (its sets together)."""
    n, sets = layout(suite, pool, l2_bytes)
    fixed = n * 32 + n * pool.kv_bytes_per_slot
    if any(c.window for c in suite.cases if c.pool == pool.name):
        fixed += n * 4
    per_case = [sets[c.name][0] * (c.slots * 4 + c.entries * 32 + c.tokens * 24) for c in suite.cases
                if c.pool == pool.name]
    return fixed + max(per_case, default=0)
