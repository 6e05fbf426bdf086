"""Runs a :class:`~.cases.Suite` on a platform and returns the results dict.

Order: copy bandwidth, gather probe, host overhead (small step, objects allocated once, graph
replay), then the cases pool by pool (each pool's canaries, one per chain kind its
cases use, and KV source are allocated once, freed after). The monitor pool runs
whole monitor steps instead (``monitor_steps``): one monitor per configuration, each
step timed with events around ``before_forward`` + ``after_forward``, the gather probe
of as many random records as the step verifies, and the host time of a step (eager
and graph replay). Every case is guarded: an error is recorded in its entry (message
and traceback tail) and the run goes on.

Results dict::

    meta   platform info, suite, runs, date, torch version, notes
    copy   buffer_bytes, bytes_moved, time_us, bandwidth_bytes_per_s
    gather [{entries, pool_slots, slot_bytes, order (random | sorted), bytes, time_us, runs,
            bandwidth_bytes_per_s}]
    host   bare_launch_us, bare_launch_args_us, plan_us, verify_us, plan_and_verify_us, write_us,
           step_us, fused_step_us (plan_and_verify + write), prepared_step_us (the same two ops
           prepared once, kc.prepare), step_device_us, graph_replay_host_us,
           graph_replay_device_us, baseline {plan_us, verify_us, write_us, step_us}
    monitor_host  case, batch, prefix, calls, eager_step_us, stamped_eager_step_us (a monitor that
                  stamps before the forward: one launch), graph_replay_host_us, graph_replay_device_us
                  (or graph_error) | {case, error}
    cases  [{name, group, batch, prefix, extend, window, mode, chain, check_tokens, kv_layers, pool_label,
             entries, tokens, sets, set_bytes, l2_flush, pool_slots, timed_ops,
             ops {op: {device_us, host_us, runs, bytes, floor_us, x_floor}},
             gather {entries, pool_slots, time_us} (monitor cases),
             baseline {ops {...}, agrees {...}} | {skipped} | {error},
             checks {violations, requested, enable, input_errors}, error}]
    targets  see report.evaluate; checks: see report.standing_checks
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import re
import sys
import time
import traceback

import numpy as np

from kvcanary_cupy import CanaryBuffer, FailReason, LaunchTag, RealKvMode, ViolationLog
from kvcanary_cupy.format import RECORD_BYTES, VIOLATION_COLUMNS

from . import cases as C
from . import floors, monitor_steps, report, workloads
from .timing import median

LOG_CAPACITY = 4096

# --- the full suite on a CPU (--device cpu without --quick) ------------------------------
# A dry run of the harness on the NumPy reference: its figures mean nothing, so it runs every
# case of the full suite at sizes a CPU handles in seconds (an H200's sizes, 21M-slot
# canaries and a 21 GB KV pool, would take hours and more memory than most hosts have).
CPU_BATCH_DIV = 16  # batches 1 / 64 / 256 / 1024 / 4096 -> 1 / 4 / 16 / 64 / 256
CPU_TOKEN_DIV = 16  # prefixes, extends and windows: p16384 -> p1024, e2048 -> e128
CPU_MAX_TOKEN_DIV = 256  # the most a short memory divides token counts by
CPU_MEMORY_SHARE = 0.25  # of the memory available when the run starts, for the largest pool's phase
CPU_PEAK_FACTOR = 3  # the peak over the pool's canaries, KV and inputs: the baseline's copies, temporaries
CPU_RUNS = 5
CPU_HOST_CALLS = 100
CPU_COPY_BYTES = 64 << 20
CPU_SOFT_DEADLINE_S = 80.0  # past this the baseline is skipped (figures mean nothing: a safety net)
CPU_HARD_DEADLINE_S = 105.0  # past this the remaining cases are skipped


def available_memory() -> int:
    """Bytes of memory available to a new process (MemAvailable; else all physical memory)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return 4 << 30


def _scaled_case(c: C.Case, bdiv: int, tdiv: int) -> C.Case:
    def t(n):
        return max(1, n // tdiv)

    batch, prefix, extend = max(1, c.batch // bdiv), (t(c.prefix) if c.prefix else 0), t(c.extend)
    window = None if c.window is None else t(c.window)
    sizes = {"b": batch, "p": prefix, "e": extend, "w": window}
    # Names follow one grammar (cases.py): b<batch>, p<prefix>, e<extend>, w<window> words.
    name = re.sub(r"\b([bpew])(\d+)\b", lambda m: f"{m.group(1)}{sizes[m.group(1)]}", c.name)
    return dataclasses.replace(c, name=name, batch=batch, prefix=prefix, extend=extend, window=window)


def _scaled_suite(s: C.Suite, bdiv: int, tdiv: int) -> C.Suite:
    area = bdiv * tdiv
    cases = tuple(_scaled_case(c, bdiv, tdiv) for c in s.cases)
    names = [c.name for c in cases]
    if len(set(names)) != len(names):
        raise ValueError(f"kvcanary: bench: scaling the suite for the CPU made two cases one: {names}")
    pools = tuple(dataclasses.replace(p, min_slots=max(4096, p.min_slots // area)) for p in s.pools)
    probes = tuple((max(1024, n // area), max(4096, slots // area), nbytes) for n, slots, nbytes in s.gather_probes)
    note = (f"CPU dry run of the {s.name} suite: batches divided by {bdiv}, token counts by {tdiv} and pools by "
            f"{area} (case names give the sizes run); the figures test the harness and mean nothing")
    return dataclasses.replace(s, name=f"{s.name}-cpu", pools=pools, cases=cases, copy_bytes=min(s.copy_bytes,
                               CPU_COPY_BYTES), host_case=_scaled_case(s.host_case, bdiv, tdiv),
                               host_calls=min(s.host_calls, CPU_HOST_CALLS), runs=min(s.runs, CPU_RUNS),
                               gather_probes=probes, monitor_host_batch=max(1, s.monitor_host_batch // bdiv),
                               soft_deadline_s=min(s.soft_deadline_s, CPU_SOFT_DEADLINE_S),
                               hard_deadline_s=min(s.hard_deadline_s, CPU_HARD_DEADLINE_S), notes=(note,))


def cpu_peak_bytes(s: C.Suite) -> int:
    """Rough peak memory of a run of ``s`` on the CPU: its largest pool's phase (pools run one
    after another, each freed before the next), with room for the baseline's copies."""
    gather = max((slots * nbytes for _, slots, nbytes in s.gather_probes), default=0)
    return CPU_PEAK_FACTOR * max([C.device_bytes(s, p, 0) for p in s.pools] + [gather])


def cpu_sized(suite: C.Suite, memory_bytes: int | None = None) -> C.Suite:
    """``suite`` sized for a CPU dry run: every case kept, batches divided by CPU_BATCH_DIV, token
    counts by CPU_TOKEN_DIV (more where the largest pool's phase would not fit CPU_MEMORY_SHARE
    of ``memory_bytes``, default: the memory available now), fewer runs and calls, deadlines
    that end the run within about two minutes."""
    memory = available_memory() if memory_bytes is None else memory_bytes
    tdiv = CPU_TOKEN_DIV
    sized = _scaled_suite(suite, CPU_BATCH_DIV, tdiv)
    while cpu_peak_bytes(sized) > CPU_MEMORY_SHARE * memory and tdiv < CPU_MAX_TOKEN_DIV:
        try:
            smaller = _scaled_suite(suite, CPU_BATCH_DIV, 2 * tdiv)
        except ValueError:  # two cases would become one: these are the smallest sizes
            break
        if cpu_peak_bytes(smaller) >= cpu_peak_bytes(sized):  # the pools' floors: no smaller
            break
        sized, tdiv = smaller, 2 * tdiv
    return sized


def _err(e: BaseException) -> str:
    tb = traceback.format_exception(type(e), e, e.__traceback__)
    return f"{type(e).__name__}: {e}\n" + "".join(tb[-6:])


def _host(a) -> np.ndarray:
    """A NumPy array of ``a`` (a NumPy or CuPy array; CuPy's copy synchronizes)."""
    return a if isinstance(a, np.ndarray) else a.get()


def _tag_name(tag: int) -> str:
    try:
        return LaunchTag(tag).name.lower()
    except ValueError:
        return str(tag)


def _short(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".splitlines()[0][:300]


class Runner:
    """One bench run. ``say`` receives progress lines (stderr by default)."""

    def __init__(self, suite: C.Suite, platform, *, baseline: bool = True, say=None):
        self.suite = suite
        self.p = platform
        self.xp = platform.xp
        self.say = say or (lambda s: print(s, file=sys.stderr, flush=True))
        self.t0 = time.monotonic()
        self.bw = 0.0
        self.monitor_host = {}
        self.torch_note = None
        self.baseline = baseline and self._torch_ok()

    # --- plumbing -----------------------------------------------------------------
    def _torch_ok(self) -> bool:
        try:
            import torch  # noqa: PLC0415

            self.p.torch_device()
            self.torch_note = f"{torch.__version__}"
            return True
        except Exception as e:  # noqa: BLE001  (no torch, or one without CUDA: run without the baseline)
            self.torch_note = f"baseline skipped: {_short(e)}"
            return False

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def _stream(self):
        return self.p.stream

    def _free(self) -> None:
        """Return cached memory; after a sticky CUDA error this fails too, which must not end the run."""
        try:
            self.p.free()
        except Exception as e:  # noqa: BLE001
            self.say(f"[bench] freeing memory failed: {_short(e)}")

    # --- the run ------------------------------------------------------------------
    def run(self) -> dict:
        s = self.suite
        meta = dict(self.p.info())
        meta.update(suite=s.name, runs=s.runs, date=datetime.datetime.now().isoformat(timespec="seconds"),
                    torch=self.torch_note, notes=list(s.notes))
        res = {"meta": meta, "copy": {}, "host": {}, "cases": []}
        self.say(f"[bench] {meta.get('device')} suite={s.name} runs={s.runs} baseline={self.baseline}")
        try:
            res["copy"] = self.p.copy_bandwidth(s.copy_bytes, s.runs)
            self._free()
            self.bw = res["copy"]["bandwidth_bytes_per_s"]
            self.say(f"[bench] copy {self.bw / 1e9:,.0f} GB/s")
        except Exception as e:  # noqa: BLE001
            res["copy"] = {"error": _short(e), "traceback": _err(e)}
            self.say(f"[bench] copy failed: {_short(e)}")
        try:
            res["gather"] = [g for n, pool, nbytes in s.gather_probes
                             for g in self.p.gather_probe(n=n, pool_slots=pool, slot_bytes=nbytes, runs=s.runs)]
            self._free()
            for g in res["gather"]:
                self.say(f"[bench] gather {g['entries']} x {g['slot_bytes']} B ({g['order']}): "
                         f"{g['time_us']:.1f} us, {g['bandwidth_bytes_per_s'] / 1e9:,.0f} GB/s")
        except Exception as e:  # noqa: BLE001
            res["gather"] = [{"error": _short(e), "traceback": _err(e)}]
            self.say(f"[bench] gather probe failed: {_short(e)}")
        try:
            res["host"] = self.host_overhead()
        except Exception as e:  # noqa: BLE001
            res["host"] = {"error": _short(e), "traceback": _err(e)}
            self.say(f"[bench] host overhead failed: {_short(e)}")
        self._free()
        for pool in s.pools:
            group = [c for c in s.cases if c.pool == pool.name]
            if group and all(c.group == "monitor" for c in group):
                res["cases"] += self.run_monitor_pool(pool, group)
            elif group:
                res["cases"] += self.run_pool(pool, group)
        res["monitor_host"] = self.monitor_host
        meta["elapsed_s"] = round(self.elapsed(), 1)
        res["targets"] = report.evaluate(res)
        res["checks"] = report.standing_checks(res)
        return res

    # --- host overhead ----------------------------------------------------------------
    def host_overhead(self) -> dict:
        s, p, xp = self.suite, self.p, self.xp
        case = s.host_case
        pool = C.Pool("host", 1_000_000 if p.kind == "cuda" else 4096)
        high = C.draw_range(case, 1, pool)
        canary = CanaryBuffer.allocate(num_slots=C.pool_slots(pool, [high]), device=p.device)
        log = ViolationLog.allocate(capacity=LOG_CAPACITY, device=p.device)
        rs = workloads.random_state(xp, 1234)
        inst = workloads.build(xp, p.device, case, workloads.draw_slots(xp, rs, case.slots, high), rs)
        workloads.populate(xp, p.device, inst, canary, log, rs, stream=self._stream())
        calls = workloads.op_calls(inst, canary, log, stream=self._stream())
        calls["plan"]()
        p.sync()
        H = s.host_calls
        timer = p.timer
        out = {"case": case.name, "calls": H}
        launch = p.bare_launchers()
        out["bare_launch_us"] = median(timer.host(launch["bare"], calls=H))
        out["bare_launch_args_us"] = median(timer.host(launch["bare_args"], calls=H))
        for op in ("plan", "verify", "write"):
            out[f"{op}_us"] = median(timer.host(calls[op], calls=H))

        def step():
            calls["plan"]()
            calls["verify"]()
            calls["write"]()

        out["step_us"] = median(timer.host(step, calls=H))
        out["sum_us"] = out["plan_us"] + out["verify_us"] + out["write_us"]
        self._fused_host(out, calls, H)
        try:
            prepared = workloads.prepared_step(inst, canary, log, stream=self._stream())
            out["prepared_step_us"] = median(timer.host(prepared, calls=H))
        except Exception as e:  # noqa: BLE001
            out["prepared_step_error"] = _short(e)
        out["step_device_us"] = timer.device(lambda _i: step(), runs=s.runs, warmup=3).device_us
        try:
            replay = p.capture(step)
            out["graph_replay_host_us"] = median(timer.host(replay, calls=H))
            out["graph_replay_device_us"] = timer.device(lambda _i: replay(), runs=s.runs, warmup=3).device_us
        except NotImplementedError as e:
            out["graph_error"] = str(e)
        except Exception as e:  # noqa: BLE001
            out["graph_error"] = _short(e)
            out["graph_traceback"] = _err(e)
        p.sync()
        out["violations"] = log.count
        self.say(f"[bench] host: bare {out['bare_launch_us']:.2f} us, plan {out['plan_us']:.2f}, "
                 f"verify {out['verify_us']:.2f}, write {out['write_us']:.2f}, step {out['step_us']:.2f}")
        if self.baseline:
            try:
                out["baseline"] = self._baseline_host(inst, canary, H)
            except Exception as e:  # noqa: BLE001
                out["baseline"] = {"error": _short(e), "traceback": _err(e)}
        return out

    def _fused_host(self, out: dict, calls: dict, H: int) -> None:
        """Host us of the fused op alone and of a step through it (plan_and_verify + write);
        an error is recorded beside the other figures, which stand."""
        def fused_step():
            calls["plan_and_verify"]()
            calls["write"]()

        try:
            out["plan_and_verify_us"] = median(self.p.timer.host(calls["plan_and_verify"], calls=H))
            out["fused_step_us"] = median(self.p.timer.host(fused_step, calls=H))
        except Exception as e:  # noqa: BLE001
            out["plan_and_verify_error"] = _short(e)

    def _baseline_host(self, inst, canary, calls: int) -> dict:
        import torch  # noqa: PLC0415

        from . import torch_baseline as tb  # noqa: PLC0415

        self.p.sync()
        dev = self.p.torch_device()
        ti = workloads.torch_instance(inst, dev)
        trec = torch.from_dlpack(canary.records).clone()
        tlog = tb.TorchLog.allocate(capacity=LOG_CAPACITY, device=dev)
        tc = workloads.torch_calls(ti, trec, tlog, chain=canary.chain)
        timer = self.p.torch_timer()
        n = max(10, min(calls, 100))  # each call synchronizes several times: fewer calls suffice
        out = {f"{op}_us": median(timer.host(tc[op], calls=n, warmup=3)) for op in ("plan", "verify", "write")}

        def step():
            tc["plan"]()
            tc["verify"]()
            tc["write"]()

        out["step_us"] = median(timer.host(step, calls=n, warmup=3))
        out["calls"] = n
        timer.sync()
        out["violations"] = int(tlog.head[0])
        self.p.sync()
        return out

    # --- cases --------------------------------------------------------------------------
    def run_pool(self, pool: C.Pool, group) -> list[dict]:
        s, p, xp = self.suite, self.p, self.xp
        N, plans = C.layout(s, pool, p.rotation_l2())
        label = f"{pool.kv_layers}x{pool.bytes_per_token}B" if pool.kv_layers else "none"
        out = []
        ctx = {}
        try:
            self.say(f"[bench] pool {pool.name}: {N:,} slots" + (f", KV {label}" if pool.kv_layers else ""))
            ctx["canaries"] = {chain: CanaryBuffer.allocate(num_slots=N, device=p.device, chain=chain)
                               for chain in sorted({c.chain for c in group})}
            ctx["log"] = ViolationLog.allocate(capacity=LOG_CAPACITY, device=p.device)
            ctx["rs"] = workloads.random_state(xp, 20240 + len(pool.name))
            ctx["sources"] = ()
            if pool.kv_layers:
                ctx["kv"] = workloads.make_kv(xp, pool.kv_layers, N, pool.bytes_per_token)
                ctx["sources"] = (workloads.kv_source(ctx["kv"]),)
            ctx["lut"] = workloads.make_lut(xp, ctx["rs"], N) if any(c.window for c in group) else None
            p.sync()
        except Exception as e:  # noqa: BLE001
            msg = _short(e)
            self.say(f"[bench] pool {pool.name} failed: {msg}")
            ctx.clear()
            self._free()
            return [self._entry(c, pool, label, N) | {"error": f"pool setup: {msg}", "traceback": _err(e)}
                    for c in group]
        for c in group:
            entry = self._entry(c, pool, label, N)
            entry["sets"], entry["l2_flush"] = plans[c.name]
            if self.elapsed() > s.hard_deadline_s:
                entry["error"] = f"skipped: past the {s.hard_deadline_s:.0f} s budget"
                out.append(entry)
                continue
            try:
                self.run_case(c, pool, ctx, entry)
            except Exception as e:  # noqa: BLE001
                entry["error"] = _short(e)
                entry["traceback"] = _err(e)
                self.say(f"[bench] {c.name}: ERROR {_short(e)}")
            self._free()
            out.append(entry)
        ctx.clear()
        self._free()
        return out

    # --- monitor steps --------------------------------------------------------------------
    def run_monitor_pool(self, pool: C.Pool, group) -> list[dict]:
        """Whole monitor steps: one monitor per configuration (see ``monitor_steps``)."""
        N, plans = C.layout(self.suite, pool, self.p.rotation_l2())
        label = f"{pool.kv_layers}x{pool.bytes_per_token}B" if pool.kv_layers else "none"
        self.say(f"[bench] pool {pool.name}: {N:,} slots, monitor steps")
        gathers = {}  # entries -> the gather probe of that many random records, measured once
        out = []
        configs = {}
        for c in group:
            configs.setdefault(monitor_steps.config_of(c), []).append(c)
        for cases in configs.values():
            entries = [self._entry(c, pool, label, N) | {"sets": plans[c.name][0], "l2_flush": plans[c.name][1],
                                                          "baseline": {"skipped": "a monitor step has no baseline"}}
                       for c in cases]
            try:
                self._run_monitor_config(pool, N, cases, entries, gathers)
            except Exception as e:  # noqa: BLE001
                for entry in entries:
                    if not entry["ops"] and not entry["error"]:
                        entry["error"] = f"monitor setup: {_short(e)}"
                        entry["traceback"] = _err(e)
                self.say(f"[bench] monitor {cases[0].name}: ERROR {_short(e)}")
            self._free()
            out += entries
        return out

    def _run_monitor_config(self, pool: C.Pool, N: int, cases, entries, gathers: dict) -> None:
        s, p, xp = self.suite, self.p, self.xp
        first = cases[0]
        rs = workloads.random_state(xp, 31337 + first.prefix)
        kv = workloads.make_kv(xp, pool.kv_layers, N, pool.bytes_per_token) if first.mode != "NONE" else None
        sources = (workloads.kv_source(kv),) if kv is not None else ()
        setup = monitor_steps.build(xp, p.device, batch=max(c.batch for c in cases), prefix=first.prefix,
                                    num_slots=N, rs=rs, sources=sources, mode=first.mode,
                                    check_tokens=first.check_tokens, stream=self._stream())
        stamped = None  # the same steps of a monitor that stamps before the forward
        if any("stamped" in c.ops for c in cases):
            stamped = monitor_steps.build(xp, p.device, batch=max(c.batch for c in cases), prefix=first.prefix,
                                          num_slots=N, rs=workloads.random_state(xp, 31337 + first.prefix),
                                          sources=sources, mode=first.mode, check_tokens=first.check_tokens,
                                          stamp=True, stream=self._stream())
        p.sync()
        for c, entry in zip(cases, entries):
            if self.elapsed() > s.hard_deadline_s:
                entry["error"] = f"skipped: past the {s.hard_deadline_s:.0f} s budget"
                continue
            try:
                self._monitor_case(c, pool, {"step": setup, "stamped": stamped}, entry, gathers, N)
            except Exception as e:  # noqa: BLE001
                entry["error"] = _short(e)
                entry["traceback"] = _err(e)
                self.say(f"[bench] {c.name}: ERROR {_short(e)}")
        hosts = [c for c in cases if c.batch == s.monitor_host_batch and c.mode == "NONE" and not c.check_tokens]
        if hosts and not self.monitor_host:
            try:
                self.monitor_host = monitor_steps.host_figures(setup, hosts[0].batch, timer=p.timer, calls=s.host_calls,
                                                               runs=s.runs, capture=p.capture)
                self.monitor_host["case"] = hosts[0].name
                self.say(f"[bench] monitor host: eager step {self.monitor_host['eager_step_us']:.1f} us")
            except Exception as e:  # noqa: BLE001
                self.monitor_host = {"error": _short(e), "traceback": _err(e), "case": hosts[0].name}
            if stamped is not None and "error" not in self.monitor_host:
                try:
                    self.monitor_host["stamped_eager_step_us"] = median(p.timer.host(stamped.step(hosts[0].batch),
                                                                                     calls=s.host_calls))
                except Exception as e:  # noqa: BLE001  (the usual monitor's figures stand)
                    self.monitor_host["stamped_error"] = _short(e)
        del setup, stamped, kv

    def _monitor_case(self, c: C.Case, pool: C.Pool, setups: dict, entry: dict, gathers: dict, N: int) -> None:
        """Times each of the case's ops (``step``, ``stamped``) on the monitor set up for it."""
        s, p = self.suite, self.p
        t_case = time.monotonic()
        nbytes = self.bytes_of(c, pool)["step"]
        fl = floors.floor_us(nbytes, self.bw)
        entry["set_bytes"] = nbytes
        for op in c.ops:
            setup = setups[op]
            before = setup.checks()["violations"]
            step = setup.step(c.batch)
            t = p.timer.device(lambda _i: step(), runs=s.runs, warmup=3, flush=True, budget_s=s.op_budget_s)
            entry["ops"][op] = t.as_dict() | {"bytes": nbytes, "floor_us": fl,
                                              "x_floor": t.device_us / fl if fl and fl == fl else None}
            checks = setup.checks()
            key = "checks" if op == "step" else f"checks_{op}"
            entry[key] = checks | {"violations": checks["violations"] - before, "expected_entries": c.entries}
        if c.entries not in gathers:
            gathers[c.entries] = self.p.gather_probe(n=c.entries, pool_slots=N, slot_bytes=RECORD_BYTES, runs=s.runs,
                                                     orders=("random",))[0]
        g = gathers[c.entries]
        entry["gather"] = {"entries": g["entries"], "pool_slots": g["pool_slots"], "time_us": g["time_us"],
                           "runs": g["runs"]}
        entry["wall_s"] = round(time.monotonic() - t_case, 2)
        timed = ", ".join(f"{op} {entry['ops'][op]['device_us']:.1f} us" for op in c.ops)
        self.say(f"[bench] {c.name}: {timed} (gather {g['time_us']:.1f} us); "
                 f"violations {entry['checks']['violations']}")

    def _entry(self, c: C.Case, pool: C.Pool, label: str, N: int) -> dict:
        verifies = "verify" in c.ops or c.group == "monitor"
        return {"name": c.name, "group": c.group, "batch": c.batch, "prefix": c.prefix, "extend": c.extend,
                "window": c.window, "mode": c.mode, "chain": c.chain, "check_tokens": c.check_tokens,
                "kv_layers": pool.kv_layers,
                "bytes_per_token": pool.bytes_per_token if pool.kv_layers else 0, "pool_label": label,
                "entries": c.entries if verifies else 0, "tokens": c.tokens, "pool_slots": N,
                "timed_ops": list(c.ops), "ops": {}, "set_bytes": None, "error": None}

    @staticmethod
    def bytes_of(c: C.Case, pool: C.Pool) -> dict:
        """Minimum bytes per op for ``c`` on ``pool`` (see floors.py)."""
        return floors.case_bytes(c, pool, index_dtype=workloads.INDEX_DTYPE, table_dtype=workloads.TABLE_DTYPE,
                                 lut_dtype=workloads.LUT_DTYPE)

    def run_case(self, c: C.Case, pool: C.Pool, ctx: dict, entry: dict) -> None:
        s, p, xp = self.suite, self.p, self.xp
        t_case = time.monotonic()
        k, flush = entry["sets"], entry["l2_flush"]
        canary, log, rs = ctx["canaries"][c.chain], ctx["log"], ctx["rs"]
        mode = RealKvMode[c.mode]
        sources = ctx["sources"]
        high = C.draw_range(c, k, pool)
        slots = workloads.draw_slots(xp, rs, k * c.slots, high)
        lut = ctx["lut"] if c.window is not None else None  # only a window translates slots
        insts = [workloads.build(xp, p.device, c, slots[i * c.slots:(i + 1) * c.slots], rs, lut)
                 for i in range(k)]
        del slots
        for inst in insts:
            workloads.populate(xp, p.device, inst, canary, log, rs, sources=sources, mode=mode, stream=self._stream())
        p.sync()
        log.clear(self._stream())
        entry["set_bytes"] = C.set_bytes(c, pool)
        calls = [workloads.op_calls(inst, canary, log, sources=sources, mode=mode, stream=self._stream())
                 for inst in insts]
        for cl in calls:  # every set planned before verify / write are timed
            cl["plan"]()
        p.sync()

        nbytes = self.bytes_of(c, pool)
        failed = []
        for op in c.ops:  # one op failing (say, one a backend lacks) keeps the others' figures
            try:
                t = p.timer.device(lambda i, op=op: calls[i % k][op](), runs=s.runs, warmup=max(3, k), flush=flush,
                                   budget_s=s.op_budget_s)
            except Exception as e:  # noqa: BLE001
                entry["ops"][op] = {"error": _short(e), "traceback": _err(e)}
                failed.append(f"{op}: {_short(e)}")
                continue
            fl = floors.floor_us(nbytes[op], self.bw)
            entry["ops"][op] = t.as_dict() | {"bytes": nbytes[op], "floor_us": fl,
                                              "x_floor": t.device_us / fl if fl and fl == fl else None}
        if failed:
            entry["error"] = "; ".join(failed)
        p.sync()
        sc = insts[0].vp.host_scalars()
        entry["checks"] = {"violations": log.count, "requested": sc["requested"], "enable": sc["enable"],
                           "input_errors": sc["input_errors"], "expected_entries": c.entries}
        if "verify" in c.ops and "write" in c.ops:
            # The timed verifies all ran before the timed writes; one more of every set now
            # shows whether a step's writes disturbed a record some set verifies (the
            # baseline, which copies the canary after the writes, would report it).
            before = log.count
            for cl in calls:
                cl["verify"]()
            p.sync()
            entry["checks"]["violations_after_write"] = log.count - before
        line = ", ".join(f"{op} {entry['ops'][op]['device_us']:.1f} us" if "device_us" in entry["ops"][op]
                         else f"{op} ERROR" for op in c.ops)
        self.say(f"[bench] {c.name}: {line}; violations {log.count}")

        if not c.baseline or not self.baseline:
            entry["baseline"] = {"skipped": "not timed for this case" if self.baseline else self.torch_note}
        elif self.elapsed() > s.soft_deadline_s:
            entry["baseline"] = {"skipped": f"past the {s.soft_deadline_s:.0f} s budget"}
        else:
            try:
                entry["baseline"] = self.run_baseline(c, insts, canary, sources, mode, k, flush)
                b = entry["baseline"]["ops"]
                self.say(f"[bench] {c.name}: torch " + ", ".join(f"{op} {b[op]['device_us']:.1f} us" for op in b))
            except Exception as e:  # noqa: BLE001
                entry["baseline"] = {"error": _short(e), "traceback": _err(e)}
                self.say(f"[bench] {c.name}: baseline ERROR {_short(e)}")
        entry["wall_s"] = round(time.monotonic() - t_case, 2)

    def run_baseline(self, c, insts, canary, sources, mode, k, flush) -> dict:
        import torch  # noqa: PLC0415

        from . import torch_baseline as tb  # noqa: PLC0415

        s, p = self.suite, self.p
        p.sync()
        dev = p.torch_device()
        trec = torch.from_dlpack(canary.records).clone()
        # The step's slots of set 0 are poisoned in the baseline's copy: only its own write restores them.
        loc0 = torch.from_dlpack(insts[0].out_cache_loc)
        trec[loc0] = -7
        tlog = tb.TorchLog.allocate(capacity=LOG_CAPACITY, device=dev)
        tsrc = [tb.TorchKvSource.from_source(src) for src in sources]
        tis = [workloads.torch_instance(inst, dev) for inst in insts]
        tcs = [workloads.torch_calls(ti, trec, tlog, sources=tsrc, mode=mode, window=c.window, chain=canary.chain)
               for ti in tis]
        for tc in tcs:
            tc["plan"]()
        timer = p.torch_timer()
        res = {"ops": {}, "agrees": {}}
        by_op = {}
        for op in (op for op in c.ops if op in tcs[0]):  # the baseline has no fused op
            before = int(tlog.head[0])
            t = timer.device(lambda i, op=op: tcs[i % k][op](), runs=s.runs, warmup=2, flush=flush,
                             budget_s=s.baseline_budget_s)
            res["ops"][op] = t.as_dict()
            by_op[op] = int(tlog.head[0]) - before  # the timer synchronized: the head is final
        # Each set owns its plans on both sides, so set 0's plans hold set 0's step.
        timer.sync()
        p.sync()
        res["agrees"] = self._agreement(c, insts, tis, canary, trec, tlog, "verify" in c.ops)
        if res["agrees"]["baseline_violations"]:
            res["agrees"]["violations_by_op"] = by_op
        timer.release()
        return res

    def _agreement(self, c, insts, tis, canary, trec, tlog, verified: bool) -> dict:
        """Plans of every set, set 0's written records and the baseline's log, against kvcanary's."""
        xp = self.xp

        def same(a, t):
            return bool(xp.array_equal(a, xp.from_dlpack(t.contiguous())))

        n = c.entries
        plan_ok = True
        for inst, ti in zip(insts, tis):
            vp, tvp = inst.vp, ti.vp
            plan_ok &= all(same(getattr(vp, f)[:n], getattr(tvp, f)[:n]) for f in
                           ("slot_indices", "prev_slot_indices", "expected_positions", "expected_tokens"))
            plan_ok &= same(vp.offsets, tvp.offsets) and same(inst.wp.offsets, ti.wp.offsets)
            plan_ok &= same(inst.wp.seed_slots, ti.wp.seed_slots)
        count = int(tlog.head[0])
        out = {"plan": plan_ok, "baseline_violations": count}
        if "write" in c.ops:
            import torch  # noqa: PLC0415

            # Only set 0's step slots were poisoned, so only they prove the baseline wrote them.
            loc = insts[0].out_cache_loc
            out["write"] = same(canary.records[loc], trec[torch.from_dlpack(loc)])
        if verified:
            out["verify"] = count == 0
        if count:
            try:
                out["first_violations"] = self._explain(c, insts, canary, trec, tlog)
            except Exception as e:  # noqa: BLE001  (a diagnosis must not hide the verdict above)
                out["first_violations"] = f"unavailable: {_short(e)}"
        return out

    def _explain(self, c, insts, canary, trec, tlog, limit: int = 4) -> list:
        """The baseline's first violation rows, each with where its slot lies in the case's
        sets (prefix position or step write) and its record in both canaries."""
        rows = tlog.rows()[:limit].cpu().numpy()
        num_slots = int(trec.shape[0])
        prefixes, steps = [], []  # per set: the slots its prefix holds, the slots its step writes
        for inst in insts:
            tab = np.asarray(_host(inst.table[1:, :c.prefix]), dtype=np.int64)
            if inst.swa is not None:
                tab = np.asarray(_host(inst.swa.lut), dtype=np.int64)[tab]
            prefixes.append(tab)
            steps.append(np.asarray(_host(inst.out_cache_loc)))
        out = []
        for row in rows:
            d = {name: int(v) for name, v in zip(VIOLATION_COLUMNS, row)}
            d["op"] = _tag_name(d["tag"])
            d["fail"] = FailReason(d["fail_bits"] & 0xFF).describe()
            slot = d["slot"]
            d["in_prefix"] = [{"set": i, "row": int(r), "position": int(pos)}
                              for i, tab in enumerate(prefixes) for r, pos in zip(*np.nonzero(tab == slot))]
            d["in_step"] = [{"set": i, "token": int(j)}
                            for i, loc in enumerate(steps) for j in np.nonzero(loc == slot)[0]]
            if 0 <= slot < num_slots:
                d["baseline_record"] = trec[slot].cpu().tolist()
                d["kvcanary_record"] = np.asarray(_host(canary.records[slot])).tolist()
            out.append(d)
        return out
