"""The targets the figures are held to, and SGLang's figures they are set against.

Pure functions of the results dict the runner builds (see ``runner.py``): each
target row names the case it reads, the figure as measured, its limit, the ratio
of the two (1.0 or less meets it) and, where there is one, SGLang's figure.
"""
from __future__ import annotations

import math

MILLION = 1_000_000

# SGLang's device times, fixed facts: measured on an H200 with the same inputs as these
# cases (CUDA events, median of 60 runs, L2 flushed). Its plan is a memset, a Triton
# offsets kernel and a CUDA entries kernel; its verify runs 64 x 512 threads; its write
# one thread per request.
SGLANG_METHOD = ("measured on an H200 with the same inputs (CUDA events, median of 60 runs, L2 flushed); "
                 "SGLang's plan = a memset + a Triton offsets kernel + a CUDA entries kernel; its verify runs "
                 "64 x 512 threads; its write one thread per request")
SGLANG_PREFIX = 4096
SGLANG_DECODE_US = {  # decode batch at prefix 4096 -> (plan, verify, write) device us
    1: (12.7, 7.0, 7.0),
    64: (23.0, 19.8, 7.0),
    256: (33.8, 62.4, 7.2),
    1024: (83.5, 219.3, 7.7),
    4096: (335.1, 903.4, 10.4),
}
SGLANG_PREFILL_WRITE_US = {(32, 16384): 5282.0}  # (batch, extend) -> write device us

# (1) a monitor decode step (prefix 4096, real-KV NONE, no token check) <= 0.5x SGLang's
# plan + verify + write, rounded as set.
MONITOR_STEP_LIMIT_US = {1: 13.0, 64: 25.0, 256: 52.0, 1024: 155.0, 4096: 625.0}
GATHER_LIMIT = 1.25  # (2) a step at >= 1M entries over the random gather of its records
ROW_WRITE_LIMIT_US = {(1, 16384): 30.0, (32, 16384): 200.0}  # (3) scan-chain prefill writes
MONITOR_HOST_LIMIT_US = 25.0  # (5) host time of an eager monitor step
GRAPH_LAUNCH_LIMIT_US = 2.0  # (5) host time of a graph replay's launch call
DECODE_WRITE_LIMIT_US = 7.0  # (6) a decode write, batches up to 1024
DECODE_WRITE_BATCHES = (1, 64, 256, 1024)
HOST_TOOL = "python -m bench.monitor_host_overhead"


def num(x):
    """``x`` if it is a finite number, else None."""
    return x if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def sglang_step_us(batch: int) -> float:
    """SGLang's plan + verify + write at ``batch`` (prefix 4096)."""
    return round(sum(SGLANG_DECODE_US[batch]), 1)


def on_cpu(results) -> bool:
    """Whether the results come from a CPU dry run (``--device cpu``)."""
    return (results.get("meta") or {}).get("platform") == "cpu"


def ok_cases(results) -> dict:
    """Cases by name. A case one of whose ops failed still counts for the figures it has: a
    target reads one op's figure, and a missing one reads as n/a."""
    return {c["name"]: c for c in results.get("cases", [])}


def chain_of(case) -> str:
    """A case's chain kind. Results from before chain kinds existed hold none: every canary
    was on the v1 chain then."""
    return case.get("chain", "sglang")


def op_us(case, op):
    """Device us of ``op`` in ``case`` (None when missing)."""
    return num(((case or {}).get("ops") or {}).get(op, {}).get("device_us"))


def scan_op_us(cases: dict, name: str, op: str):
    """Device us of ``op`` in case ``name`` if that case ran on the scan chain (else None)."""
    c = cases.get(name)
    return op_us(c, op) if c is not None and chain_of(c) == "scan" else None


def monitor_name(batch: int, prefix: int = SGLANG_PREFIX, label: str = "NONE") -> str:
    return f"monitor b{batch} p{prefix} {label}"


class _Rows:
    """Collects target rows; on a CPU dry run every verdict is n/a (the targets are a GPU's)."""

    def __init__(self, cpu: bool):
        self.cpu = cpu
        self.rows = []

    def add(self, tid: str, target: str, case: str, value, limit, *, sglang=None, detail: str = "",
            strict: bool = False, unit: str = "us"):
        value, limit = num(value), num(limit)
        ratio = value / limit if value is not None and limit else None
        if value is None or limit is None:
            result = "n/a"
        elif strict:
            result = "PASS" if value < limit else "MISS"
        else:
            result = "PASS" if value <= limit else "MISS"
        row = {"id": tid, "target": target, "case": case, "value": value, "limit": limit, "ratio": ratio,
               "unit": unit, "sglang_us": num(sglang), "result": "n/a" if self.cpu else result, "detail": detail}
        if self.cpu:
            row["note"] = "GPU target"
        self.rows.append(row)


def evaluate(results) -> list[dict]:
    """Every target row, in the order of the targets (1) to (6)."""
    rows = _Rows(on_cpu(results))
    cases = ok_cases(results)
    _monitor_steps(rows, cases)
    _gather_bound(rows, cases)
    _row_writes(rows, cases)
    _plans(rows, cases)
    _host(rows, results.get("monitor_host") or {})
    _decode_writes(rows, cases)
    return rows.rows


def _missing(name, cases) -> str:
    return "" if name in cases else "not run"


def _monitor_steps(rows: _Rows, cases: dict) -> None:
    """Each batch twice: the monitor that stamps before the forward (``stamped``: a step of at
    most 256 tokens is one launch) and the one that stamps after it (``step``: two launches)."""
    for b, limit in MONITOR_STEP_LIMIT_US.items():
        name = monitor_name(b)
        for op, how in (("stamped", "stamp_before_forward"), ("step", "stamped after the forward")):
            rows.add("1", f"monitor step bs {b} <= 0.5x SGLang's step, {how}", name, scan_op_us(cases, name, op),
                     limit, sglang=sglang_step_us(b),
                     detail=_missing(name, cases) or "before_forward + after_forward, device")


def _gather_bound(rows: _Rows, cases: dict) -> None:
    big = [c for c in cases.values() if c.get("group") == "monitor" and c.get("mode") == "NONE"
           and not c.get("check_tokens") and c.get("entries", 0) >= MILLION]
    if not big:
        rows.add("2", "step <= 1.25x gather of its records", "-", None, None,
                 detail="no monitor step of >= 1M entries ran")
    for c in sorted(big, key=lambda c: c["entries"]):
        g = num((c.get("gather") or {}).get("time_us"))
        for op in c.get("timed_ops", ["step"]):
            step = op_us(c, op)
            x = f"; {op} = {step / g:.2f}x gather" if step is not None and g else ""
            rows.add("2", f"{op} <= 1.25x gather, {c['entries'] >> 20}Mi records", c["name"], step,
                     GATHER_LIMIT * g if g is not None else None,
                     detail=(f"gather {g:.1f} us of {c['entries']:,} random 32 B records" if g is not None
                             else "no gather figure") + x)


def _row_writes(rows: _Rows, cases: dict) -> None:
    for (b, e), limit in ROW_WRITE_LIMIT_US.items():
        name = f"prefill b{b} e{e}"
        v1 = op_us(cases.get(f"{name} sglang"), "write")
        rows.add("3", f"scan-chain write, {b} x {e} tokens", name, scan_op_us(cases, name, "write"), limit,
                 sglang=SGLANG_PREFILL_WRITE_US.get((b, e)),
                 detail=_missing(name, cases) or (f"kvcanary's v1 chain: {v1:,.0f} us" if v1 is not None else ""))


def _plans(rows: _Rows, cases: dict) -> None:
    for b, (plan, _, _) in SGLANG_DECODE_US.items():
        name = f"decode b{b} p{SGLANG_PREFIX}"
        rows.add("4", f"plan bs {b} faster than SGLang's", name, scan_op_us(cases, name, "plan"), plan, sglang=plan,
                 strict=True, detail=_missing(name, cases))


def _host(rows: _Rows, host: dict) -> None:
    case = host.get("case", "-")
    err = host.get("error")
    rows.add("5", "monitor host per eager step", case, None if err else host.get("eager_step_us"),
             MONITOR_HOST_LIMIT_US, detail=f"error: {err}" if err else "bound buffers, CPU us per step")
    if host.get("stamped_eager_step_us") is not None:
        rows.add("5", "monitor host per eager step, stamped before the forward", case,
                 host["stamped_eager_step_us"], MONITOR_HOST_LIMIT_US, detail="bound buffers, one launch")
    gerr = err or host.get("graph_error")
    rows.add("5", "graph replay's launch call", case, None if gerr else host.get("graph_replay_host_us"),
             GRAPH_LAUNCH_LIMIT_US, detail=f"error: {gerr}" if gerr else "a captured monitor step, CPU us")
    rows.add("5", "monitor host per step, its own tool", f"run {HOST_TOOL}", None, MONITOR_HOST_LIMIT_US,
             detail="its own configuration; not measured by this run")


def _decode_writes(rows: _Rows, cases: dict) -> None:
    for b in DECODE_WRITE_BATCHES:
        mine = [c for c in cases.values() if c.get("group") == "decode" and c.get("batch") == b
                and chain_of(c) == "scan" and op_us(c, "write") is not None]
        worst = max(mine, key=lambda c: op_us(c, "write"), default=None)
        rows.add("6", f"decode write bs {b} <= 7 us", worst["name"] if worst else f"decode b{b}",
                 op_us(worst, "write"), DECODE_WRITE_LIMIT_US, sglang=SGLANG_DECODE_US[b][2],
                 detail=f"worst of {len(mine)} prefixes" if mine else "not run")
