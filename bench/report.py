"""Results -> targets, a markdown report, JSON, and the short table of targets printed last.

Pure functions of the results dict the runner builds (see ``runner.py`` for its
shape), so the whole report can be produced and tested from a made-up dict. The
targets and SGLang's figures live in ``targets.py``; the standing checks below are
the earlier targets, still reported beside them.
"""
from __future__ import annotations

import json
import math
import os

from . import targets as T

BEGIN = "<!-- bench:begin -->"
END = "<!-- bench:end -->"
MILLION = 1_000_000
evaluate = T.evaluate  # the targets table (see targets.py)

# The standing checks.
FLOOR_LIMIT = 1.3  # plan / verify time over floor at >= 1M entries
HOST_LIMIT = 1.5  # host time per op over a bare kernel launch
STEP_HOST_LIMIT_US = 30.0  # CPU time of the three ops of a step
BASELINE_MIN_SPEEDUP = 5.0  # baseline device time over kvcanary's at >= 1M entries


def _num(x):
    return x if isinstance(x, (int, float)) and not (isinstance(x, float) and math.isnan(x)) else None


def _op(case, op, side="ops"):
    if side == "ops":
        return (case.get("ops") or {}).get(op) or {}
    return ((case.get("baseline") or {}).get("ops") or {}).get(op) or {}


def _ok_cases(results):
    return [c for c in results.get("cases", []) if not c.get("error")]


def _big(results, groups, mode=None, kv_layers=None):
    out = []
    for c in _ok_cases(results):
        if c["group"] not in groups or c.get("entries", 0) < MILLION:
            continue
        if mode is not None and c.get("mode") != mode:
            continue
        if kv_layers is not None and c.get("kv_layers") != kv_layers:
            continue
        out.append(c)
    return out


def _verdict(value, limit, higher_is_better=False):
    if value is None:
        return "n/a"
    ok = value >= limit if higher_is_better else value <= limit
    return "PASS" if ok else "MISS"


def _worst_ratio(cases, op):
    """(worst time/floor, the case it came from) over ``cases``."""
    best = (None, None)
    for c in cases:
        r = _num(_op(c, op).get("x_floor"))
        if r is not None and (best[0] is None or r > best[0]):
            best = (r, c["name"])
    return best


SEPARATE_OPS = ("plan", "verify", "write")  # a step as the baseline runs it: no fused op


def step_device_us(case, side="ops"):
    """Device time of the separate ops a case times (plan, verify, write), summed (None if any is missing)."""
    timed = [op for op in case.get("timed_ops", SEPARATE_OPS) if op in SEPARATE_OPS]
    ts = [_num(_op(case, op, side).get("device_us")) for op in timed]
    return None if not ts or any(t is None for t in ts) else sum(ts)


on_cpu = T.on_cpu


def standing_checks(results) -> list[dict]:
    """The earlier targets: each with its value, limit, PASS / MISS (n/a when not measured) and
    where it came from.

    Every check is a GPU's: on a CPU dry run each is ``n/a`` with ``note`` "GPU target"
    (its value is still what the dry run measured).
    """
    t = []
    cpu = on_cpu(results)

    def add(name, value, limit, detail, higher=False, unit="x"):
        t.append({"target": name, "value": value, "limit": limit, "unit": unit,
                  "result": "n/a" if cpu else _verdict(value, limit, higher), "detail": detail})
        if cpu:
            t[-1]["note"] = "GPU target"

    big = _big(results, ("decode", "swa"))
    def worst(where):
        return f"worst: {where}" if where else "no case >= 1M entries"

    v, where = _worst_ratio(big, "plan")
    add("plan <= 1.3x floor at >= 1M entries", v, FLOOR_LIMIT, worst(where))
    v, where = _worst_ratio(big, "verify")
    add("verify <= 1.3x floor at >= 1M entries", v, FLOOR_LIMIT, worst(where))
    kv = _big(results, ("real_kv",), mode="ALL", kv_layers=1)
    v, where = _worst_ratio(kv, "verify")
    add("verify, real-KV ALL 256 B/token, <= 1.3x floor at >= 1M entries", v, FLOOR_LIMIT, worst(where))

    host = results.get("host") or {}
    bare = _num(host.get("bare_launch_us"))
    for op in ("plan", "verify", "write"):
        x = _num(host.get(f"{op}_us"))
        ratio = x / bare if x is not None and bare else None
        add(f"host: {op} <= 1.5x a bare launch", ratio, HOST_LIMIT,
            f"{x:.2f} us vs bare {bare:.2f} us" if ratio is not None else "not measured")
    step = _num(host.get("step_us"))
    add("host: plan + verify + write <= 30 us of CPU", step, STEP_HOST_LIMIT_US,
        "one call of each, median" if step is not None else "not measured", unit="us")

    speedups = []
    for c in _big(results, ("decode", "swa", "real_kv")):
        k, b = step_device_us(c), step_device_us(c, "baseline")
        if k and b:
            speedups.append((b / k, c["name"]))
    v, where = min(speedups) if speedups else (None, None)
    add("baseline >= 5x slower (device time of a step) at >= 1M entries", v, BASELINE_MIN_SPEEDUP,
        f"smallest: {where}" if where else "no baseline at >= 1M entries", higher=True)
    bh = _num(((host.get("baseline") or {}).get("step_us")))
    ratio = bh / step if bh is not None and step else None
    add("baseline takes more host time per step", ratio, 1.0,
        f"torch {bh:.1f} us vs kvcanary {step:.1f} us" if ratio is not None else "not measured", higher=True)
    return t


def write_rows(results) -> list[dict]:
    """The one-row writes, per source and chain kind: total (ALL), chain only (NONE), fingerprint part."""
    by = {}
    for c in _ok_cases(results):
        if c["group"] != "write_row":
            continue
        row = by.setdefault((c["pool_label"], T.chain_of(c)), {"tokens": c["tokens"]})
        row[c["mode"]] = _num(_op(c, "write").get("device_us"))
    out = []
    cpu = on_cpu(results)
    for (label, chain), m in by.items():
        total, alone = m.get("ALL"), m.get("NONE")
        part = total - alone if total is not None and alone is not None else None
        # On a CPU dry run the two wall-clock times are noisy enough that the total can come out
        # below the chain alone: no fingerprint part can be read from that difference.
        noise = cpu and part is not None and part < 0
        out.append({"source": label, "chain": chain, "tokens": m["tokens"], "all_us": total, "chain_us": alone,
                    "fingerprint_us": None if noise else part, "fingerprint_noise": noise})
    return out


# --- formatting ------------------------------------------------------------------------
def _f(x, digits=1):
    x = _num(x)
    if x is None:
        return "-"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.{digits}f}"


def _x(x):
    """A ratio: ``1.23x``."""
    x = _num(x)
    return "-" if x is None else f"{x:.2f}x"


def _count(n):
    if n is None:
        return "-"
    if n >= MILLION and n % (1 << 20) == 0:
        return f"{n >> 20}Mi"
    if n >= MILLION:
        return f"{n / MILLION:.1f}M"
    if n >= 10_000 and n % 1024 == 0:
        return f"{n >> 10}Ki"
    return str(n)


def _table(header, rows) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return out


def _section(title: str, header, rows) -> list[str]:
    """A bold caption, a blank line, the table and a blank line."""
    return [title, ""] + _table(header, rows) + [""]


def _gather_lines(results, bw) -> list[str]:
    """The gather probe: what scattered slots cost before any checking is done."""
    probes = [g for g in results.get("gather") or [] if isinstance(g, dict) and not g.get("error")]
    if not probes:
        return []
    rows = []
    for g in probes:
        gbw = _num(g.get("bandwidth_bytes_per_s"))
        rows.append([_count(g.get("entries")), _count(g.get("pool_slots")), f"{g.get('slot_bytes')} B",
                     g.get("order", "?"), _f(g.get("time_us")), _f(gbw / 1e9 if gbw else None, 0),
                     _f(bw / gbw if bw and gbw else None, 2)])
    return _section("**Gather probe** (`bench_gather`: read each slot's bytes at n indices and nothing else; bytes = "
                    "8 B index + slot bytes per entry; x copy time = its time over the copy floor of the same bytes)",
                    ["entries", "pool slots", "per slot", "slots", "us", "GB/s", "x copy time"], rows)


def _head_lines(results, bw) -> list[str]:
    meta = results.get("meta", {})
    copy = results.get("copy") or {}
    lines = [f"Measured on **{meta.get('device', '?')}** ({meta.get('platform', '?')}), {meta.get('date', '?')}; "
             f"suite `{meta.get('suite', '?')}`, medians of {meta.get('runs', '?')} runs "
             f"(baseline: fewer where one call is long, see `runs` in the JSON). "
             f"CuPy {meta.get('cupy', '-')}, torch {meta.get('torch', '-')}.", ""]
    if on_cpu(results):
        lines += ["A CPU dry run (`--device cpu`): the harness on the NumPy reference and CPU torch. Its figures "
                  "are wall-clock times of a CPU, not a GPU's, and the targets apply to a GPU only (n/a here).", ""]
    if bw is not None:
        lines.append(f"Copy bandwidth (device-to-device copy of {_count(copy.get('buffer_bytes'))}B, bytes read + "
                     f"written): **{bw / 1e9:,.0f} GB/s** ({_f(copy.get('time_us'))} us). Floors below are "
                     "each op's minimum bytes at this bandwidth.")
    elif copy.get("error"):
        lines.append(f"Copy bandwidth: error: {copy['error']}")
    return lines + [""]


def _ops_lines(results) -> list[str]:
    rows = []
    for c in results.get("cases", []):
        if c.get("group") == "monitor":
            continue
        if c.get("error") and not any("device_us" in o for o in (c.get("ops") or {}).values()):
            rows.append([c["name"], _count(c.get("entries")), _count(c.get("tokens")), "error", "-", "-", "-",
                         "-", "-", "-"])
            continue
        for op in c.get("timed_ops", []):
            k, b = _op(c, op), _op(c, op, "baseline")
            if "device_us" not in k:  # this op failed; the case's error says why
                rows.append([c["name"], _count(c.get("entries")), _count(c.get("tokens")), f"{op}: error", "-", "-",
                             "-", "-", "-", "-"])
                continue
            kd, bd = _num(k.get("device_us")), _num(b.get("device_us"))
            rows.append([c["name"], _count(c.get("entries")), _count(c.get("tokens")), op, _f(kd),
                         _f(k.get("floor_us")), _f(k.get("x_floor"), 2), _f(bd), _f(bd / kd if bd and kd else None),
                         f"{_f(k.get('host_us'))} / {_f(b.get('host_us'))}"])
    if not rows:
        return []
    return _section("**Ops** (device time per call; floor = minimum bytes / copy bandwidth; torch = the PyTorch "
                    "baseline, which has no fused op; host = CPU time of the Python call, kvcanary / torch; "
                    "`plan_and_verify` is the fused op, which writes no per-entry arrays)",
                    ["case", "entries", "tokens", "op", "us", "floor us", "x floor", "torch us", "torch / kvc",
                     "host us"], rows)


def _gather_x(c):
    """(gather us, step / gather) of a monitor case."""
    g, t = _num((c.get("gather") or {}).get("time_us")), _num(_op(c, "step").get("device_us"))
    return g, (t / g if g and t is not None else None)


def _monitor_lines(results) -> list[str]:
    rows = []
    for c in results.get("cases", []):
        if c.get("group") != "monitor":
            continue
        if c.get("error"):
            rows.append([c["name"], _count(c.get("entries")), "error", "-", "-", "-", "-", "-", "-", "-"])
            continue
        k, st = _op(c, "step"), _op(c, "stamped")
        g, x = _gather_x(c)
        sd = _num(st.get("device_us"))
        rows.append([c["name"], _count(c.get("entries")), _f(k.get("device_us")), _f(sd), _f(k.get("floor_us")),
                     _f(k.get("x_floor"), 2), _f(g), _f(x, 2), _f(sd / g if sd is not None and g else None, 2),
                     _f(k.get("host_us"))])
    if not rows:
        return []
    return _section("**Monitor steps** (`KvCanary.before_forward` + `after_forward`, one new token per row, bound "
                    "buffers; device time = CUDA events around both calls on the monitor's stream, L2 flushed before "
                    "each run; gather = `bench_gather` of as many random 32 B records from the same pool; host = CPU "
                    "time of both calls in the timed runs; NONE = real-KV NONE, no token check; PARTIAL+tokens = "
                    "real-KV PARTIAL over one 256 B/token source and the token check on; stamped = the same step "
                    "of a monitor made with `stamp_before_forward=True`, which stamps in `before_forward`: one "
                    "launch for a step of at most 256 tokens)",
                    ["case", "entries", "step us", "stamped us", "floor us", "x floor", "gather us", "step / gather",
                     "stamped / gather", "host us"], rows)


def _sglang_lines(results) -> list[str]:
    """kvcanary beside SGLang's fixed figures, decode at prefix 4096 and the 32 x 16K prefill write."""
    cases = T.ok_cases(results)
    if not any(c.get("group") in ("decode", "monitor") for c in cases.values()):
        return []
    rows = []
    for b, (plan, verify, write) in T.SGLANG_DECODE_US.items():
        d = f"decode b{b} p{T.SGLANG_PREFIX}"
        ops = [_f(T.scan_op_us(cases, d, op)) for op in ("plan", "verify", "plan_and_verify", "write")]
        step = T.scan_op_us(cases, T.monitor_name(b), "step")
        stamped = T.scan_op_us(cases, T.monitor_name(b), "stamped")
        full = T.scan_op_us(cases, T.monitor_name(b, label="PARTIAL+tokens"), "step")
        sg = T.sglang_step_us(b)
        rows.append([b, _f(plan), _f(verify), _f(write), _f(sg), *ops, _f(step),
                     _x(step / sg if step is not None else None), _f(stamped),
                     _x(stamped / sg if stamped is not None else None), _f(full)])
    lines = _section(f"**Beside SGLang** (decode, prefix {T.SGLANG_PREFIX}, device us. SGLang's figures are fixed: "
                     f"{T.SGLANG_METHOD}. kvcanary's: the ops cases `decode bN p4096` and the monitor steps above)",
                     ["batch", "SGLang plan", "SGLang verify", "SGLang write", "SGLang step", "plan", "verify",
                      "plan_and_verify", "write", "monitor step", "step / SGLang step", "stamped step",
                      "stamped / SGLang step", "step, PARTIAL+tokens"], rows)
    prow = []
    for (b, e), sg in T.SGLANG_PREFILL_WRITE_US.items():
        scan = T.scan_op_us(cases, f"prefill b{b} e{e}", "write")
        v1 = T.op_us(cases.get(f"prefill b{b} e{e} sglang"), "write")
        prow.append([f"{b} x {e}", _f(sg), _f(scan), _x(scan / sg if scan is not None else None), _f(v1)])
    return lines + _section("**Prefill write beside SGLang** (device us; kvcanary on the scan chain and on the v1 "
                            "chain, SGLang's records)",
                            ["batch x tokens", "SGLang", "scan chain", "scan / SGLang", "v1 chain"], prow)


def _host_lines(results) -> list[str]:
    host = results.get("host") or {}
    if host.get("error"):
        return [f"Host overhead: error: {host['error']}", ""]
    if not host:
        return []
    bare = _num(host.get("bare_launch_us"))

    def xb(v):
        v = _num(v)
        return _f(v / bare, 2) if v is not None and bare else "-"

    hb = host.get("baseline") or {}
    rows = [["bare RawKernel launch, no args", _f(bare, 2), "1.00", "-"],
            ["bare RawKernel launch, 8 args", _f(host.get("bare_launch_args_us"), 2),
             xb(host.get("bare_launch_args_us")), "-"]]
    for op in ("plan", "verify", "plan_and_verify", "write"):
        rows.append([op, _f(host.get(f"{op}_us"), 2), xb(host.get(f"{op}_us")), _f(hb.get(f"{op}_us"), 1)])
    rows.append(["step: plan + verify + write", _f(host.get("step_us"), 2), xb(host.get("step_us")),
                 _f(hb.get("step_us"), 1)])
    rows.append(["step: plan_and_verify + write", _f(host.get("fused_step_us"), 2), xb(host.get("fused_step_us")),
                 "-"])
    rows.append(["step: plan_and_verify + write, prepared once (`kc.prepare`)", _f(host.get("prepared_step_us"), 2),
                 xb(host.get("prepared_step_us")), "-"])
    if host.get("graph_error"):
        rows.append(["graph replay of a step", f"error: {host['graph_error']}", "-", "-"])
    else:
        rows.append(["graph replay of a step (launch call)", _f(host.get("graph_replay_host_us"), 2),
                     xb(host.get("graph_replay_host_us")), "-"])
    lines = _section(f"**Host overhead** (CPU us per call, median of {host.get('calls', '?')} calls, "
                     f"`{host.get('case', '?')}`, buffers imported once, no sync per call)",
                     ["call", "us", "x bare", "torch us"], rows)
    lines += [f"Device time of a step: eager {_f(host.get('step_device_us'))} us, "
              f"one graph replay {_f(host.get('graph_replay_device_us'))} us.", ""]
    return lines + _monitor_host_lines(results.get("monitor_host") or {})


def _monitor_host_lines(mh: dict) -> list[str]:
    if not mh:
        return []
    if mh.get("error"):
        return [f"Monitor host time: error: {mh['error']}", ""]
    replay = (f"error: {mh['graph_error']}" if mh.get("graph_error") else
              f"{_f(mh.get('graph_replay_host_us'), 2)} us (its device time {_f(mh.get('graph_replay_device_us'))} us)")
    return [f"Monitor step `{mh.get('case', '?')}`, CPU us (median of {mh.get('calls', '?')} steps, bound buffers): "
            f"eager `before_forward` + `after_forward` {_f(mh.get('eager_step_us'), 2)} us (stamping before the "
            f"forward, one launch: {_f(mh.get('stamped_eager_step_us'), 2)} us); a CUDA graph replay's "
            f"launch call {replay}.", ""]


def _write_row_lines(results) -> list[str]:
    wr = write_rows(results)
    if not wr:
        return []
    noise = any(r["fingerprint_noise"] for r in wr)
    return _section("**Write of one row** (device us; the chain alone is the real-KV NONE variant; scan = format v2, "
                    "the default; sglang = the v1 chain, serial"
                    + ("; fingerprint part n/a: the total came out below the chain alone, wall-clock noise)"
                       if noise else ")"),
                    ["source", "chain", "tokens", "total, real-KV ALL", "chain alone", "fingerprint part"],
                    [[r["source"], r["chain"], _count(r["tokens"]), _f(r["all_us"]), _f(r["chain_us"]),
                      "n/a" if r["fingerprint_noise"] else _f(r["fingerprint_us"])] for r in wr])


def markdown(results) -> str:
    """The full report as markdown (what goes between the README's markers)."""
    bw = _num((results.get("copy") or {}).get("bandwidth_bytes_per_s"))
    lines = _head_lines(results, bw)
    lines += _gather_lines(results, bw)
    lines += _ops_lines(results)
    lines += _monitor_lines(results)
    lines += _sglang_lines(results)
    lines += _host_lines(results)
    lines += _write_row_lines(results)
    lines += _section("**Targets** (measured, its limit and the ratio of the two: 1.00x or less meets it; SGLang = "
                      "SGLang's figure for the same case)",
                      ["#", "target", "case", "measured", "limit", "ratio", "SGLang us", "result", "detail"],
                      [r[:7] + [f"**{r[7]}**", r[8]] for r in _target_rows(results)])
    lines += ["**Standing checks** (the earlier targets)", ""]
    lines += _table(["check", "value", "limit", "result", "where"], _check_rows(results))
    notes = list(results.get("meta", {}).get("notes", []))
    if notes:
        lines.append("")
        lines += [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def _result(t) -> str:
    return f"{t['result']} ({t['note']})" if t.get("note") else t["result"]


def _us(v) -> str:
    return "-" if _num(v) is None else f"{_f(v)} us"


def _target_rows(results) -> list[list]:
    """[#, target, case, measured, limit, ratio, SGLang us, result, detail] per target."""
    rows = []
    for t in results.get("targets") or evaluate(results):
        rows.append([t["id"], t["target"], t["case"], _us(t["value"]), _us(t["limit"]), _x(t["ratio"]),
                     _f(t.get("sglang_us")), _result(t), t.get("detail", "")])
    return rows


def _check_rows(results) -> list[list]:
    rows = []
    for t in results.get("checks") or standing_checks(results):
        unit = t.get("unit", "x")
        val = "-" if t["value"] is None else (f"{t['value']:.2f}{unit}" if unit == "x" else f"{t['value']:.1f} {unit}")
        lim = f"{t['limit']}{unit}" if unit == "x" else f"{t['limit']} {unit}"
        rows.append([t["target"], val, lim, f"**{_result(t)}**", t["detail"]])
    return rows


def summary(results) -> str:
    """The short table of targets, printed last on stdout (the result last on each line)."""
    bw = _num((results.get("copy") or {}).get("bandwidth_bytes_per_s"))
    head = f"copy bandwidth: {bw / 1e9:,.0f} GB/s" if bw else "copy bandwidth: -"
    errs = [c["name"] for c in results.get("cases", []) if c.get("error")]
    header = ["#", "target", "case", "measured", "limit", "ratio", "SGLang us", "result"]
    rows = [r[:8] for r in _target_rows(results)]
    w = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]

    def line(r):
        return "  ".join(str(c).ljust(w[i]) for i, c in enumerate(r)).rstrip()

    out = [head, line(header), line(["-" * x for x in w])]
    out += [line(r) for r in rows]
    if errs:
        out.append(f"cases with errors ({len(errs)}): " + ", ".join(errs))
    return "\n".join(out)


# --- files ---------------------------------------------------------------------------
def _clean(x):
    """JSON-safe copy: NaN / inf become null."""
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if hasattr(x, "item") and hasattr(x, "dtype"):  # NumPy / CuPy scalars
        return _clean(x.item())
    return x


def write_json(results, path: str) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    with open(path, "w") as f:
        json.dump(_clean(results), f, indent=1, allow_nan=False)
        f.write("\n")


def splice(text: str | None, body: str) -> str:
    """``text`` with the part between the bench markers replaced by ``body``.

    Without markers the block is appended; with no text it is the whole file.
    """
    block = f"{BEGIN}\n{body.rstrip()}\n{END}"
    if not text:
        return block + "\n"
    i, j = text.find(BEGIN), text.find(END)
    if i < 0 or j < i:
        return text.rstrip("\n") + "\n\n" + block + "\n"
    return text[:i] + block + text[j + len(END):]


def update_markdown(path: str, body: str) -> None:
    """Rewrite the bench block of ``path`` (creating the file if needed)."""
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        text = None
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    with open(path, "w") as f:
        f.write(splice(text, body))
