"""Tensor-parallel scenarios run in real processes, one per rank, over torch.distributed.

:func:`run_ranks` spawns ``world`` processes that join a process group (gloo on the
CPU, NCCL with one GPU per rank; a ``file://`` rendezvous in a fresh temporary
directory, so nothing listens on a port), run one scenario of :data:`SCENARIOS` and
send back what it returned, or its traceback. A failure or a hang in any rank
fails the caller with every rank's traceback; the processes are ended on the way out.

The scenarios drive :class:`ToyTP`, a small decode engine written in PyTorch
(tables, inputs and the K/V pool are tensors on the rank's device, imported
zero copy by the monitor), so the same code runs on CPUs and GPUs. Each rank
writes its own K/V bytes (other heads: the rank is part of the bytes), so
fingerprints differ across ranks and agreement must not compare them.

PyTorch is imported inside the functions: importing this module costs nothing.
"""
from __future__ import annotations

import os
import queue
import sys
import tempfile
import traceback

import numpy as np

ROWS, WIDTH, LAYERS, BPT = 3, 24, 2, 32  # request rows 1..ROWS, positions per row, K/V geometry
NUM_SLOTS = 1 + 2 * ROWS * WIDTH  # room for a second home of every row (transfers land there)
PROMPT = 5


# --- the harness ------------------------------------------------------------------------
def run_ranks(scenario: str, *, world: int = 2, backend: str = "gloo", timeout: float = 120.0, **kwargs) -> list:
    """Run ``SCENARIOS[scenario](rank, world, device, **kwargs)`` on ``world`` ranks; returns each
    rank's result, in rank order."""
    import torch.multiprocessing as mp  # noqa: PLC0415

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="kvcanary-tp-") as tmp:
        init = f"file://{os.path.join(tmp, 'rendezvous')}"
        procs = [ctx.Process(target=_child, args=(rank, world, backend, init, scenario, kwargs, results), daemon=True)
                 for rank in range(world)]
        for p in procs:
            p.start()
        got: dict = {}
        errors: list = []
        try:
            while len(got) + len(errors) < world:
                try:
                    status, rank, payload = results.get(timeout=timeout)
                except queue.Empty:
                    missing = sorted(set(range(world)) - set(got) - {r for r, _ in errors})
                    raise AssertionError(f"{scenario}: rank(s) {missing} sent nothing within {timeout:.0f} s "
                                         f"(a hang in a collective?); other ranks' errors: {errors}") from None
                if status == "ok":
                    got[rank] = payload
                else:
                    errors.append((rank, payload))
                    break  # the others may now wait forever in a collective
        finally:
            for p in procs:
                p.join(timeout=5 if not errors else 0.5)
                if p.is_alive():
                    p.kill()
                    p.join()
        if errors:
            raise AssertionError("\n".join(f"{scenario}: rank {r} failed:\n{tb}" for r, tb in errors))
        bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (0, None) and r not in got]
        assert not bad, f"{scenario}: ranks exited abnormally: {bad}"
    return [got[r] for r in range(world)]


def _child(rank, world, backend, init, scenario, kwargs, results):
    try:
        os.environ["NCCL_NVLS_ENABLE"] = "0"  # NVLink multicast stays off on these machines
        if backend == "gloo" and sys.platform == "linux":
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one host: loopback, whatever the hostname resolves to
        import torch  # noqa: PLC0415
        import torch.distributed as dist  # noqa: PLC0415

        device = "cpu"
        if backend == "nccl":
            torch.cuda.set_device(rank)
            import cupy  # noqa: PLC0415

            cupy.cuda.Device(rank).use()
            device = f"cuda:{rank}"
        dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
        try:
            out = SCENARIOS[scenario](rank, world, device, **kwargs)
        finally:
            dist.destroy_process_group()
        results.put(("ok", rank, out))
    except BaseException:  # noqa: BLE001  (everything goes back to the test, which fails with it)
        results.put(("error", rank, traceback.format_exc()))


# --- a small PyTorch decode engine --------------------------------------------------------
class ToyTP:
    """``ROWS`` requests: a prefill of ``PROMPT`` tokens, then one token per row per step.

    Row ``r`` position ``p`` lives in slot ``home[r, p]`` (a shuffled layout, the same on
    every rank); token ids are ``1000 r + p``. The K/V pool is uint8
    ``[LAYERS, NUM_SLOTS, BPT]``; the bytes of a token depend on the rank too.
    """

    def __init__(self, rank: int, device: str, *, process_group=None, policy="log", bind=False, **mon_kw):
        import torch  # noqa: PLC0415

        import kvcanary_cupy as kc  # noqa: PLC0415

        self.torch, self.kc, self.rank, self.device = torch, kc, rank, device
        dev = torch.device(device)
        g = torch.Generator().manual_seed(1234)  # the same layout on every rank
        perm = torch.randperm(ROWS * WIDTH, generator=g) + 1
        self.home = torch.zeros(ROWS + 1, WIDTH, dtype=torch.int64)
        self.home[1:] = perm.view(ROWS, WIDTH)
        self.r2t = torch.zeros(ROWS + 1, WIDTH, dtype=torch.int32, device=dev)
        self.pool = torch.zeros(LAYERS, NUM_SLOTS, BPT, dtype=torch.uint8, device=dev)
        self.P = [0] * (ROWS + 1)
        src = kc.RealKvSource(self.pool, page_size=1, bytes_per_token=BPT, layer_axis=True)
        self.mon = kc.KvCanary(num_slots=NUM_SLOTS, req_to_token=self.r2t, max_batch=ROWS, device=device,
                               real_kv=src, policy=policy, process_group=process_group, **mon_kw)
        self.polls: list = []  # per poll: [(str, reasons, rank, reference_rank, agreement_step, tag)]
        self.bound = None
        if bind:
            self.bound = {k: torch.zeros(n, dtype=torch.int64, device=dev) for k, n in (
                ("rpi", ROWS), ("pre", ROWS), ("ext", ROWS), ("ids", ROWS), ("pos", ROWS), ("loc", ROWS))}
            b = self.bound
            self.mon.bind_inputs(req_pool_indices=b["rpi"], prefix_lens=b["pre"], extend_lens=b["ext"],
                                 input_ids=b["ids"], positions=b["pos"], out_cache_loc=b["loc"])

    def kv_bytes(self, ids, pos):
        """uint8 ``[LAYERS, n, BPT]``: what this rank's heads hold for each token."""
        torch = self.torch
        j = torch.arange(BPT, device=ids.device)
        layer = torch.arange(LAYERS, device=ids.device).view(-1, 1, 1)
        v = ids.view(1, -1, 1) * 131 + pos.view(1, -1, 1) * 7 + self.rank * 13 + layer * 3 + j
        return (v % 251).to(torch.uint8)

    def _batch(self, rows, extend):
        torch = self.torch
        dev = self.pool.device
        ids, pos, loc = [], [], []
        for r in rows:
            for p in range(self.P[r], self.P[r] + extend):
                self.r2t[r, p] = int(self.home[r, p])
                ids.append(1000 * r + p)
                pos.append(p)
                loc.append(int(self.home[r, p]))
        t = lambda v: torch.tensor(v, dtype=torch.int64, device=dev)  # noqa: E731
        return t(list(rows)), t([self.P[r] for r in rows]), t([extend] * len(rows)), t(ids), t(pos), t(loc)

    def write_kv(self, ids, pos, loc):
        self.pool[:, loc] = self.kv_bytes(ids, pos)

    def step(self, rows=None, extend=1, poll=True):
        """One eager step over ``rows`` (default all), ``extend`` new tokens each."""
        rows = list(range(1, ROWS + 1)) if rows is None else rows
        rpi, pre, ext, ids, pos, loc = self._batch(rows, extend)
        self.mon.before_forward(rpi, pre, ext, request_ids=[f"req-{r}" for r in rows])
        self.write_kv(ids, pos, loc)
        self.mon.after_forward(ids, pos, loc)
        for r in rows:
            self.P[r] += extend
        if poll:
            self.poll()

    def poll(self):
        found = []
        try:
            found = self.mon.poll()
        except self.kc.KvCanaryError as e:
            self.polls.append(("raised", describe(e.violations)))
            return
        self.polls.append(("ok", describe(found)))

    def drain(self):
        """On CUDA poll returns one copy late: settle the device and poll once more."""
        if self.device != "cpu":
            self.torch.cuda.synchronize()
        self.poll()


def describe(found) -> list:
    return [(str(v), int(v.reasons), v.rank, v.reference_rank, v.agreement_step, int(v.tag), v.other_ranks_rows)
            for v in found]


def _world_group():
    import torch.distributed as dist  # noqa: PLC0415

    return dist.group.WORLD


# --- scenarios: each returns plain data for the test to check ------------------------------
def clean_decode(rank, world, device, steps=12):
    """Prefill, then decode steps: nothing found on any rank, every step agreed."""
    e = ToyTP(rank, device, process_group=_world_group())
    e.step(extend=PROMPT)
    for _ in range(steps):
        e.step()
    e.drain()
    return {"polls": e.polls, "stats": e.mon.stats()}


def divergence(rank, world, device, at=6, steps=10):
    """Rank 1 changes one slot-table entry of row 2's prefix before step ``at``."""
    e = ToyTP(rank, device, process_group=_world_group())
    e.step(extend=PROMPT)
    for i in range(1, steps + 1):
        if i == at and rank == 1:
            e.r2t[2, 1] = int(e.home[3, WIDTH - 1])  # a slot of another row, never stamped yet
        e.step()
    e.drain()
    return {"polls": e.polls, "stats": e.mon.stats()}


def policy_raise(rank, world, device, at=4, steps=8):
    """Only rank 1's records are hit by a stray write; policy 'raise' raises on every rank in the same poll."""
    e = ToyTP(rank, device, process_group=_world_group(), policy="raise")
    e.step(extend=PROMPT)
    for i in range(1, steps + 1):
        if i == at and rank == 1:
            slot = int(e.home[1, 2])
            e.mon.canary.records[slot, 0] += 1  # a stray write on this rank's canary only
        e.step()
    e.drain()
    return {"polls": e.polls, "stats": e.mon.stats()}


def sweep_late(rank, world, device, at=3, steps=6):
    """Rank 1 sweeps an idle chain nobody stamped after step ``at``'s agreement: its rows wait for the
    next agreement, then both ranks report in the same poll."""
    import kvcanary_cupy as kc  # noqa: PLC0415

    e = ToyTP(rank, device, process_group=_world_group())
    e.step(extend=PROMPT)
    for i in range(1, steps + 1):
        e.step(poll=False)
        if i == at and rank == 1:
            e.mon.sweep([kc.SweepChain(e.home[3, WIDTH - 2:].numpy(), 0, -1, key="idle")])
        e.poll()
    e.drain()
    return {"polls": e.polls, "stats": e.mon.stats()}


def sim_tp(rank, world, device, steps=40, seed=3):
    """The simulator (prefix hits, chunked prefill, SWA, a draft pool, sweeps) on every rank, with its
    monitors in the process group: silent, and every step agreed."""
    import functools  # noqa: PLC0415
    from unittest import mock  # noqa: PLC0415

    from kvcanary_cupy.monitor import KvCanary  # noqa: PLC0415
    from kvcanary_cupy.sim import PagedKvSim, SimConfig, engine  # noqa: PLC0415

    with mock.patch.object(engine, "KvCanary", functools.partial(KvCanary, process_group=_world_group())):
        sim = PagedKvSim(SimConfig(device=device, seed=seed))
    recs = sim.run(steps)
    return {"violations": [(r.step, m, str(v)) for r in recs for m, v in r.violations],
            "stats": {m: mon.stats() for m, mon in sim.monitors.items()}, "steps": steps}


def transfer(rank, world, device, corrupt=False):
    """Rank 0 prefills row 1 and sends its KV and records (torch.distributed send/recv) to rank 1, which
    places them in other slots (row 2's second home), imports the records and decodes on: a clean verify,
    or REAL_KV when a byte was corrupted in transit."""
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    e = ToyTP(0, device)  # the same K/V bytes on both sides: one rank's heads moving, not a TP group
    n = PROMPT + 3
    dev = e.pool.device
    if rank == 0:
        e.step(rows=[1], extend=n)
        slots = e.home[1, :n].numpy()
        records = e.mon.export_slots(slots)
        rec_t = torch.from_numpy(records) if device == "cpu" else torch.from_dlpack(records)
        kv = e.pool[:, torch.as_tensor(slots, device=dev)].contiguous()
        dist.send(rec_t, dst=1)
        dist.send(kv, dst=1)
        e.drain()
        return {"polls": e.polls, "sent": slots.tolist()}
    rec_t = torch.empty(n, 4, dtype=torch.int64, device=dev)
    kv = torch.empty(LAYERS, n, BPT, dtype=torch.uint8, device=dev)
    dist.recv(rec_t, src=0)
    dist.recv(kv, src=0)
    if corrupt:
        kv[1, 3, 0] ^= 0x40  # one byte of position 3, layer 1, flipped on the way
    landing = e.home[2, WIDTH - n:].numpy()[::-1].copy()  # other slots, in another order than the sender's
    e.pool[:, torch.as_tensor(landing, device=dev)] = kv
    e.mon.import_slots(landing, rec_t)
    e.r2t[1, :n] = torch.as_tensor(landing, dtype=torch.int32, device=dev)
    e.home[1, :n] = torch.as_tensor(landing)
    e.P[1] = n
    for _ in range(3):
        e.step(rows=[1])
    e.drain()
    return {"polls": e.polls, "landing": landing.tolist()}


def graph_divergence(rank, world, device, replays=8, at=4):
    """CUDA only: one decode step captured in a CUDA graph on every rank, the agreement's collective
    included; replays stay clean until rank 1 changes a slot-table entry in place, then both ranks
    report rank 1. Also returns whether the capture ran anything (it must not)."""
    import torch  # noqa: PLC0415

    e = ToyTP(rank, device, process_group=_world_group(), bind=True, verify_capacity="max")
    e.step(extend=PROMPT)
    b = e.bound
    rows = list(range(1, ROWS + 1))

    def refill():
        for k, v in zip(("rpi", "pre", "ext", "ids", "pos", "loc"), e._batch(rows, 1)):
            b[k].copy_(v)

    def body():
        stream = torch.cuda.current_stream()
        e.mon.before_forward(batch_size=ROWS, stream=stream)
        e.pool[:, b["loc"]] = e.kv_bytes(b["ids"], b["pos"])
        e.mon.after_forward(num_tokens=ROWS, stream=stream)

    refill()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with e.mon.warmup(stream=side):
        with torch.cuda.stream(side):
            for _ in range(2):  # the first decode step, twice: idempotent
                body()
        torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    before = e.mon.stats()["agreement_steps"]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        body()
    torch.cuda.synchronize()
    captured_ran = e.mon.stats()["agreement_steps"] != before
    for r in rows:
        e.P[r] += 1
    for i in range(replays):
        if i == at and rank == 1:
            e.r2t[2, 1] = int(e.home[3, WIDTH - 1])
        refill()
        graph.replay()
        e.mon.note_step()
        for r in rows:
            e.P[r] += 1
        e.poll()
    e.drain()
    return {"polls": e.polls, "stats": e.mon.stats(), "captured_ran": captured_ran}


def misuse(rank, world, device):
    """What a monitor refuses for a process group."""
    import kvcanary_cupy as kc  # noqa: PLC0415

    out = {}
    for name, pg in (("not a group", "world"), ("None-like", 0)):
        try:
            kc.KvCanary(num_slots=8, req_to_token=np.zeros((2, 4), np.int32), max_batch=1, device=device,
                        process_group=pg)
            out[name] = None
        except (TypeError, ValueError) as err:
            out[name] = f"{type(err).__name__}: {err}"
    return out


SCENARIOS = {f.__name__: f for f in (clean_decode, divergence, policy_raise, sweep_late, sim_tp, transfer,
                                      graph_divergence, misuse)}
