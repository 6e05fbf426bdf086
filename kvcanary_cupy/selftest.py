"""``python -m kvcanary_cupy selftest``: prove, on this machine, that the canary is
silent on a clean engine and catches every fault class, with each chain kind.

A clean run drives the simulator (token-level and page-level tables, prefix
sharing, chunked prefill, decode, a sliding-window pool, a draft pool, eviction,
sweeps, sampled fingerprints, the verify after the write) and must find nothing.
Then, per fault class, each injection runs in a fresh simulator: a few clean
steps, the fault, and the steps until the detector tied to that class reports it.
The whole campaign runs once per chain kind (``"scan"`` and ``"sglang"`` by
default, see :class:`~kvcanary_cupy.CanaryBuffer`); it passes only if every kind does.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field

import numpy as np

from .backends import use_cpu_backend
from .cli import CliParser, output_path_problem
from .format import CHAINS, RealKvMode, check_chain
from .monitor import KvCanaryWarning
from .sim import FAULTS, PagedKvSim, SimConfig

WARM_STEPS = 4  # clean steps before arming a fault
CHAIN_CHOICES = (*CHAINS, "both")
ARM_STEPS = 80  # steps a fault may wait for a target (e.g. a cached block) before it counts as not injected
WAIT_STEPS = 12  # steps after injection the tied detector has to report


@dataclass
class ClassResult:
    number: int
    name: str
    detector: str
    requested: int
    injected: int = 0
    detected: int = 0
    steps: list = field(default_factory=list)
    false_positives: int = 0
    clean_steps: int = 0
    other: int = 0  # violations after injection from other detectors (collateral, not false positives)
    misses: list = field(default_factory=list)

    @property
    def median_steps(self):
        return statistics.median(self.steps) if self.steps else None

    @property
    def ok(self) -> bool:
        return self.injected == self.requested and self.detected == self.requested and self.false_positives == 0

    def as_dict(self) -> dict:
        return {"number": self.number, "name": self.name, "detector": self.detector, "requested": self.requested,
                "injected": self.injected, "detected": self.detected, "median_steps": self.median_steps,
                "steps": self.steps, "false_positives": self.false_positives, "clean_steps": self.clean_steps,
                "other_detections": self.other, "misses": self.misses, "ok": self.ok}


def cuda_status() -> tuple[bool, str]:
    """Whether CuPy is importable and sees a CUDA device, and if not, why (one phrase)."""
    try:
        import cupy  # noqa: PLC0415
    except Exception as e:  # noqa: BLE001  (not installed, or broken: either way no CUDA backend)
        if isinstance(e, ModuleNotFoundError) and (e.name or "").split(".")[0] == "cupy":
            return False, "CuPy is not installed"
        return False, f"CuPy is installed but cannot be imported ({_reason(e)})"
    try:
        n = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as e:  # noqa: BLE001  (no driver, driver too old, no device)
        return False, f"CuPy is installed but found no CUDA device ({_reason(e)})"
    if n < 1:
        return False, "CuPy is installed but found no CUDA device (device count 0)"
    return True, f"CuPy sees {n} CUDA device{'s' if n > 1 else ''}"


def _reason(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text and text[0] else type(e).__name__


def resolve_backend(backend: str) -> str:
    """``"cpu"`` or ``"cuda"`` for ``auto`` / ``numpy`` / ``cuda``: ``auto`` is ``"cuda"``
    when CuPy is installed and sees a device, else ``"cpu"`` (the NumPy backend)."""
    if backend in ("numpy", "numba"):
        return "cpu"
    if backend == "cuda":
        return "cuda"
    if backend != "auto":
        raise ValueError(f"kvcanary: backend: expected auto, numpy, numba or cuda, got {backend!r}")
    return "cuda" if cuda_status()[0] else "cpu"


def configs(device: str, seed: int) -> list[SimConfig]:
    """The two engine shapes every run alternates: token-level and page-level tables."""
    return [SimConfig(device=device, page_size=1, num_pages=320, seed=seed),
            SimConfig(device=device, page_size=4, num_pages=80, seed=seed)]


def clean_configs(device: str, seed: int) -> list[SimConfig]:
    """The clean run adds two shapes: 2-slot pages, a short window, odd chunks, sampled
    fingerprints and the second verify after the write; and monitors that stamp a step's
    records before its forward (no fingerprints, so the step is one launch per group)."""
    return configs(device, seed) + [
        SimConfig(device=device, page_size=2, num_pages=160, swa_window=5, chunk=7, sample_period=3,
                  verify_after=True, seed=seed),
        SimConfig(device=device, page_size=4, num_pages=80, real_kv_mode=RealKvMode.NONE, stamp_before_forward=True,
                  seed=seed)]


def chains_of(chain: str) -> tuple[str, ...]:
    """The chain kinds a run covers: ``"both"`` is every kind, else the one named."""
    if chain == "both":
        return CHAINS
    return (check_chain(chain, "chain"),)


def clean_run(device: str, steps: int, seed: int, progress, chain: str = CHAINS[0]) -> dict:
    out = {"steps": 0, "violations": 0, "input_errors": 0, "rows_unstamped": 0, "overflows": 0, "examples": [],
           "slots_checked": 0, "sweep_entries": 0, "prefix_hits": 0}
    cfgs = [dataclasses.replace(c, chain=chain) for c in clean_configs(device, seed)]
    per = [steps // len(cfgs) + (i < steps % len(cfgs)) for i in range(len(cfgs))]
    for cfg, n in zip(cfgs, per):
        if n == 0:
            continue
        sim = PagedKvSim(cfg)
        for k in range(n):
            rec = sim.step()
            out["violations"] += len(rec.violations)
            out["examples"] += [f"step {rec.step} {m}: {v}" for m, v in rec.violations][:5 - len(out["examples"])]
            if (out["steps"] + k + 1) % 500 == 0:
                progress(f"  clean run: {out['steps'] + k + 1}/{steps} steps, {out['violations']} violations")
        out["steps"] += n
        out["prefix_hits"] += sim.stats_prefix_hits
        for mon in sim.monitors.values():
            s = mon.stats()
            out["input_errors"] += s["input_errors"]
            out["rows_unstamped"] += s["rows_unstamped"]
            out["overflows"] += s["overflows"]
            out["slots_checked"] += s["slots_checked"]
            out["sweep_entries"] += s["sweep_entries"]
    return out


def inject_once(fault_cls, device: str, seed: int, variant: int, res: ClassResult, chain: str = CHAINS[0],
                events=None) -> None:
    run_name = f"{chain}:{fault_cls.__name__}:{seed}"
    # Every injection's engine numbers its requests from scratch: its run names them apart.
    tagged = None if events is None else (lambda e: events(dict(e, run=run_name, request=f"{run_name}/{e['request']}")))
    cfg = dataclasses.replace(configs(device, seed)[variant % 2], chain=chain, events=tagged, name=run_name)
    sim = PagedKvSim(cfg)
    fault = fault_cls(np.random.default_rng(seed + 7))
    for _ in range(WARM_STEPS):
        rec = sim.step()
        res.false_positives += len(rec.violations)
        res.clean_steps += 1
    armed, found = False, False
    for _ in range(ARM_STEPS + WAIT_STEPS):
        if not armed:
            armed = fault.arm(sim)
        rec = sim.step()
        if fault.fired_at is None or rec.step < fault.fired_at:
            res.false_positives += len(rec.violations)
            res.clean_steps += 1
            if fault.fired_at is None and sim.clock >= WARM_STEPS + ARM_STEPS:
                break
            continue
        hits = [v for m, v in rec.violations if fault.matches(m, v)]
        res.other += len(rec.violations) - len(hits)
        if hits:
            found = True
            res.steps.append(rec.step - fault.fired_at)
            break
        if rec.step - fault.fired_at >= WAIT_STEPS:
            break
    for mon in sim.monitors.values():
        mon.close()  # the run is over: its open incidents end (an incident_end event each)
    if fault.fired_at is not None:
        res.injected += 1
        res.detected += int(found)
    if not found:
        res.misses.append({"seed": seed, "variant": variant, "fired_at": fault.fired_at,
                           "info": {k: str(v) for k, v in fault.info.items()}})


def run(*, backend: str = "auto", steps: int = 2000, injections: int = 20, seed: int = 0, chain: str = "both",
        progress=print, notice=None, events=None) -> dict:
    """Run the whole selftest; returns the report (see ``--json``).

    ``chain``: ``"scan"``, ``"sglang"`` or ``"both"`` (the default): the campaign (the
    clean run of ``steps`` steps and ``injections`` injections per fault class) runs once
    per kind, each in simulators of its own; the report's ``chains`` maps each kind to
    its result (``ok``, ``seconds``, ``clean``, ``classes``), and ``ok`` is true only if
    every kind passed.

    ``progress`` receives the progress lines; ``notice`` (default: ``progress``) the one
    line that says why ``auto`` runs on NumPy although CuPy is installed. ``events``: a
    callable that receives the incident events of every injection's monitors (each with
    a ``run`` naming its chain kind, fault class and seed; the monitors are named after it).

    The monitors' own warnings (e.g. out-of-range plan input a fault provokes) are
    silenced while it runs; the clean run's input errors and overflows are counted
    in the report instead.
    """
    kinds = chains_of(chain)
    log = logging.getLogger("kvcanary")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", KvCanaryWarning)
            return _run(backend, steps, injections, seed, kinds, progress, notice or progress, events)
    finally:
        log.setLevel(level)


def _run(backend: str, steps: int, injections: int, seed: int, kinds, progress, notice, events=None) -> dict:
    note = None
    if backend == "auto":
        usable, why = cuda_status()
        device = "cuda" if usable else "cpu"
        if not usable and why.startswith("CuPy is installed"):
            note = f"{why}: running on the NumPy backend"
            notice(note)
    else:
        device = resolve_backend(backend)
    name = "cuda" if device == "cuda" else ("numba" if backend == "numba" else "numpy")
    t0 = time.perf_counter()
    each = " per chain kind" if len(kinds) > 1 else ""
    where = {"numpy": "the NumPy backend (cpu)", "numba": "the numba backend (cpu)", "cuda": "CUDA"}[name]
    progress(f"kvcanary selftest on {where}, chain "
             f"kind{'s' if len(kinds) > 1 else ''} {', '.join(kinds)}: {steps} clean steps, {injections} "
             f"injections x {len(FAULTS)} fault classes{each}, seed {seed}")
    previous = use_cpu_backend(name) if device == "cpu" else None
    try:
        per_kind = {k: _campaign(device, steps, injections, seed, k, progress, events) for k in kinds}
    finally:
        if previous is not None:
            use_cpu_backend(previous)
    return {"ok": all(r["ok"] for r in per_kind.values()), "backend": name,
            "device": device, "seed": seed, "backend_note": note, "seconds": round(time.perf_counter() - t0, 2),
            "chains": per_kind}


def _campaign(device: str, steps: int, injections: int, seed: int, chain: str, progress, events=None) -> dict:
    """One chain kind's clean run and injections."""
    t0 = time.perf_counter()
    progress(f"chain {chain!r}:")
    clean = clean_run(device, steps, seed, progress, chain)
    progress(f"  clean run: {clean['violations']} violations, {clean['input_errors']} input errors "
             f"({time.perf_counter() - t0:.1f} s)")
    classes = []
    for fc in FAULTS:
        t1 = time.perf_counter()
        res = ClassResult(fc.number, fc.name, fc.detector, injections)
        for i in range(injections):
            inject_once(fc, device, seed * 1_000_003 + fc.number * 1009 + i, i, res, chain, events)
        classes.append(res)
        med = "-" if res.median_steps is None else f"{res.median_steps:g}"
        progress(f"  [{fc.number:2d}/{len(FAULTS)}] {fc.name}: {res.detected}/{res.injected} detected, "
                 f"median {med} steps, {res.false_positives} false positives ({time.perf_counter() - t1:.1f} s)")
    ok = (clean["violations"] == 0 and clean["input_errors"] == 0 and clean["rows_unstamped"] == 0
          and all(c.ok for c in classes))
    return {"ok": ok, "seconds": round(time.perf_counter() - t0, 2), "clean": clean,
            "classes": [c.as_dict() for c in classes]}


def format_table(report: dict) -> str:
    """The summary: per chain kind its verdict and a table of the fault classes and the clean
    run, then the overall verdict (the last line)."""
    out = []
    for kind, r in report["chains"].items():
        out += [f"chain {kind!r}: {'PASS' if r['ok'] else 'FAIL'} in {r['seconds']:.1f} s", _kind_table(r), ""]
    out.append(f"{'PASS' if report['ok'] else 'FAIL'} (chain kinds: {', '.join(report['chains'])}) in "
               f"{report['seconds']:.1f} s on {report['backend']}")
    return "\n".join(out)


def _kind_table(report: dict) -> str:
    rows = [("#", "fault class", "tied detector", "injected", "detected", "median steps", "false pos.")]
    for c in report["classes"]:
        med = "-" if c["median_steps"] is None else f"{c['median_steps']:g}"
        rows.append((str(c["number"]), c["name"], c["detector"], str(c["injected"]), str(c["detected"]), med,
                     str(c["false_positives"])))
    cl = report["clean"]
    rows.append(("-", "clean run", "all", "-", "-", "-", str(cl["violations"])))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(x.ljust(w) if j in (1, 2) else x.rjust(w) for j, (x, w) in enumerate(zip(r, widths)))
             for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    before = sum(c["clean_steps"] for c in report["classes"])
    fp = cl["violations"] + sum(c["false_positives"] for c in report["classes"])
    lines.append("")
    lines.append(f"clean steps (no fault in effect): {cl['steps'] + before} = {cl['steps']} in the clean run "
                 f"+ {before} in the injection runs before their fault fired; false positives over them: {fp}")
    lines.append(f"clean run: input errors: {cl['input_errors']}, plan overflows: {cl['overflows']}, "
                 f"prefix hits: {cl['prefix_hits']}")
    lines.append("median steps: steps after the first step that could see the fault (0: that very step)")
    return "\n".join(lines)


def main(argv=None, prog: str = "python -m kvcanary_cupy selftest") -> int:
    ap = CliParser(
        prog=prog, command="selftest",
        description="Clean run plus every fault class on a simulated paged-KV engine, once per chain kind. "
                    "Exits 0 when, for every kind, every injected fault is caught and the clean run reports "
                    "nothing, 1 otherwise.")
    ap.add_argument("--backend", choices=("auto", "numpy", "numba", "cuda"), default="auto",
                    help="auto (default): CUDA when CuPy is installed and sees a device, else the NumPy "
                         "backend; numpy: the NumPy reference on the CPU; numba: the same ops compiled by "
                         "numba, on the CPU; cuda: the CUDA kernels through CuPy")
    ap.add_argument("--chain", choices=CHAIN_CHOICES, default="both",
                    help="the canaries' chain kind: scan (format v2), sglang (v1, SGLang's records) or both "
                         "(default: the whole campaign once per kind, passing only if both pass)")
    ap.add_argument("--steps", type=int, default=2000, help="clean-run steps per chain kind (default 2000)")
    ap.add_argument("--injections", type=int, default=20,
                    help="injections per fault class and chain kind (default 20)")
    ap.add_argument("--seed", type=int, default=0,
                    help="seed of the simulated engines and the fault injectors (default 0)")
    ap.add_argument("--json", metavar="PATH", help="also write the report as JSON to PATH")
    ap.add_argument("--events", metavar="PATH",
                    help="append the incident events of the fault injections to PATH as JSON lines "
                         "(python -m kvcanary_cupy report PATH summarizes them)")
    ap.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = ap.parse_args(argv)
    if args.steps < 0 or args.injections < 1:
        ap.error("--steps must be >= 0 and --injections >= 1")
    for flag, path in (("--json", args.json), ("--events", args.events)):
        problem = output_path_problem(path) if path is not None else None
        if problem:
            print(f"kvcanary: selftest: {flag} {path!r}: {problem}; expected the path of a file in an "
                  "existing, writable folder (checked before the run)", file=sys.stderr)
            return 2
    if args.backend == "numba" and importlib.util.find_spec("numba") is None:
        print("kvcanary: selftest: --backend numba needs numba (pip install numba); run with --backend numpy "
              "(or auto) for the NumPy backend", file=sys.stderr)
        return 2
    if args.backend == "cuda":
        usable, why = cuda_status()
        if not usable:
            print(f"kvcanary: selftest: --backend cuda needs CuPy and a CUDA device: {why}; "
                  "run with --backend numpy (or auto) for the NumPy backend", file=sys.stderr)
            return 2
    progress = (lambda s: None) if args.quiet else (lambda s: print(s, file=sys.stderr, flush=True))
    sink = None if args.events is None else open(args.events, "a", encoding="utf-8")
    try:
        write = None if sink is None else (lambda e: sink.write(json.dumps(e, default=str) + "\n"))
        report = run(backend=args.backend, steps=args.steps, injections=args.injections, seed=args.seed,
                     chain=args.chain, progress=progress, notice=lambda s: print(s, file=sys.stderr, flush=True),
                     events=write)
    finally:
        if sink is not None:
            sink.close()
    print(format_table(report))
    for kind, r in report["chains"].items():
        for c in r["classes"]:
            for m in c["misses"][:3]:
                print(f"  missed ({kind}): class {c['number']} {m}")
        for e in r["clean"]["examples"]:
            print(f"  clean-run violation ({kind}): {e}")
    if args.json:
        try:
            with open(args.json, "w") as f:
                json.dump(report, f, indent=2)
        except OSError as e:
            print(f"kvcanary: selftest: --json {args.json}: cannot write the report: {e.strerror or e}",
                  file=sys.stderr)
            return 2
    return 0 if report["ok"] else 1
