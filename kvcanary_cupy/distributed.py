"""Tensor-parallel agreement: the ranks of a process group check, every step, that they
planned and wrote the same thing.

Under tensor parallelism every rank holds its own KV heads but runs the same
scheduler decisions: the same slot tables, plans and write inputs. A rank whose
bookkeeping drifted (a table entry written on one rank only, an input buffer
refilled late) corrupts its share of the KV while its own canary, which checks
that rank against itself, may see nothing. So each step, at the end of
:meth:`~kvcanary_cupy.KvCanary.after_forward`, every rank:

1. digests, on the device, what must be equal on all ranks (:class:`~kvcanary_cupy.digest.Digest`):
   per watched pool the digest of its verify entries (slot, prev slot, expected
   position, expected token; :func:`~kvcanary_cupy.plan_and_verify` computes it where
   it derives them), the verify plan's offsets and scalars (num_valid, enable,
   requested), the write plan (offsets, seed slots, num_rows); and the step's write
   inputs (input_ids, positions, out_cache_loc of each pool). Rank-local
   real-KV fingerprints are not compared: each rank fingerprints other heads.
   The digest runs in one extra block of the step's last write launch
   (``ops.write(digest=)``), beside the write: one launch less per step.
2. gathers ``[digest, log head]`` from every rank in ONE collective on the monitor's
   stream (``all_gather_into_tensor``, or its successor ``all_gather_single`` where
   PyTorch has it: 16 bytes per rank, through zero-copy PyTorch views of the
   monitor's own arrays): NCCL on GPUs, where it is captured in a CUDA graph with
   the rest of the step; gloo on CPUs, a plain blocking call;
3. compares the digests on the device (:class:`~kvcanary_cupy.digest.RankCompare`):
   a rank whose digest differs from the majority's (two ranks: from rank 0's) is
   named in a RANK_DIVERGENCE row, tag TP_AGREE, appended to the log of EVERY rank
   in that same step (``Violation.rank`` reads it), and the ranks' log heads are
   summed into the group's tally (less the divergence rows every rank holds a copy
   of: counted once, in ``divergences``, they would otherwise make the next step's
   tally grow on every rank and fire every poll a second time).

The policy then decides alike on every rank: :meth:`Agreement.release` hands a
poll the rows its rank logged up to the latest agreement (later rows, e.g. a
sweep's, wait for the next one), and fires when the *group's* tally grew, so a
rank that found nothing itself gets a group notice (``Violation.other_ranks_rows``)
in the same poll in which the rank that found something gets its rows. It reads
only what the poll's one-step-late pinned copy already brings.

Every rank must run the same steps (each after_forward is a collective), with
the same monitor configuration. PyTorch is imported only when an
:class:`Agreement` is made.
"""
from __future__ import annotations

import collections

import numpy as np

from . import arrays, runtime
from .digest import Digest, DigestRow, RankCompare
from .format import AGREE_STATE_FIELDS, LaunchTag
from .violations import Violation

WORDS = 2  # what each rank contributes to the collective: its digest, its log head
_DIGESTS_KEPT = 8  # descriptor tables kept, one per distinct set of step arrays
_AT = {f: i for i, f in enumerate(AGREE_STATE_FIELDS)}


def _torch():
    try:
        import torch  # noqa: PLC0415  (optional: only a monitor with a process group needs it)
        import torch.distributed as dist  # noqa: PLC0415
    except ImportError as e:
        raise ValueError(f"kvcanary: process_group: tensor-parallel agreement needs PyTorch ({e}); "
                         "pip install 'kvcanary_cupy[torch]'") from None
    return torch, dist


def torch_view(a):
    """A zero-copy PyTorch tensor over a monitor-owned NumPy / CuPy array."""
    torch, _ = _torch()
    if isinstance(a, np.ndarray):
        return torch.from_numpy(a)
    return torch.from_dlpack(a)


def step_rows(groups, *, input_ids, positions, locs) -> list[DigestRow]:
    """What must agree across ranks after a step: per group (see :mod:`kvcanary_cupy.monitor.group`)
    the digest of its verify entries (which :func:`~kvcanary_cupy.plan_and_verify` computes
    where it derives them, so they are never written or read again), the verify plan's
    offsets and scalars and the write plan, then the step's write inputs (``locs``: each
    group's out_cache_loc). Every array here is written whole by the plan (rows past the
    batch included) or counted by the plan's own scalars, so equal plans digest equal."""
    rows = []
    for g in groups:
        vp, wp = g.vp, g.wp
        rows.append(DigestRow(g.entry_digest))
        rows += [DigestRow(vp.offsets), DigestRow(vp.num_valid), DigestRow(vp.enable), DigestRow(vp.requested)]
        rows += [DigestRow(wp.offsets), DigestRow(wp.seed_slots), DigestRow(wp.num_rows)]
    rows += [DigestRow(input_ids), DigestRow(positions)] + [DigestRow(loc) for loc in locs]
    return rows


def _key(rows) -> tuple:
    """A digest's identity: the memory its descriptor table points at (addresses, lengths, widths)."""
    def at(a):
        return 0 if a is None else arrays.data_ptr(a)
    return tuple((at(r.array), int(r.array.shape[0]), r.array.itemsize, at(r.count), at(r.gate)) for r in rows)


class Agreement:
    """A monitor's agreement with the other ranks of ``process_group``.

    Args:
        process_group: a ``torch.distributed`` process group holding every rank of the
            tensor-parallel group (e.g. ``torch.distributed.group.WORLD``): NCCL for a
            monitor on CUDA, gloo for one on the CPU.
        device: the monitor's device.
        log: the monitor's :class:`~kvcanary_cupy.ViolationLog`, whose head is ``send[1]``.
        send: int64 ``[2]`` from :meth:`allocate_send`: the collective sends it,
            ``[digest, log head]``.
        keepalive: holds descriptor tables dropped while queued work may read them.

    Attributes:
        rank, world: this rank and the group's size.
        state: int64 device array, ``format.AGREE_STATE_FIELDS``.
    """

    def __init__(self, process_group, *, device: str, log, send, keepalive=None):
        torch, dist = _torch()
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("kvcanary: process_group: torch.distributed is not initialized; call "
                             "torch.distributed.init_process_group(...) on every rank first")
        if not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(f"kvcanary: process_group: expected a torch.distributed ProcessGroup (e.g. "
                            f"torch.distributed.group.WORLD), got {type(process_group).__name__}")
        backend = str(dist.get_backend(process_group)).lower()
        cpu = runtime.is_cpu(device)
        if cpu and "gloo" not in backend:
            raise ValueError(f"kvcanary: process_group: a monitor on cpu exchanges host arrays, which needs a gloo "
                             f"group, got backend {backend!r}")
        if not cpu and "nccl" not in backend:
            raise ValueError(f"kvcanary: process_group: a monitor on {device} exchanges device arrays on its stream, "
                             f"which needs an NCCL group, got backend {backend!r}")
        self.group = process_group
        self.world = int(dist.get_world_size(process_group))
        self.rank = int(dist.get_rank(process_group))
        if self.rank < 0:
            raise ValueError("kvcanary: process_group: this process is not a member of the group")
        self.device = device
        self.log = log
        self._keepalive = keepalive
        self._torch = torch
        self._gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        self.send = arrays.as_array(send, "send", dtypes=arrays.INT64, ndim=1, device=device, writable=True)
        if self.send.shape[0] != WORDS or arrays.data_ptr(log.head) != arrays.data_ptr(self.send) + 8:
            raise ValueError("kvcanary: send: expected the int64 [2] buffer whose word 1 is the log's head "
                             "(Agreement.allocate_send(), then ViolationLog.allocate(..., head=send[1:]))")
        self.recv = runtime.empty((self.world, WORDS), np.int64, device, fill=0)
        self.state = RankCompare.allocate_state(device)
        # The concatenated form ([world * WORDS]): every backend takes it (gloo takes no stacked output).
        self._send_t, self._recv_t = torch_view(self.send), torch_view(self.recv.reshape(-1))
        self._compare = RankCompare(self.recv, rank=self.rank, state=self.state, log=log, tag=LaunchTag.TP_AGREE)
        self._digests: collections.OrderedDict = collections.OrderedDict()
        self._streams: dict = {}  # stream pointer -> torch.cuda.ExternalStream
        self._torch_device = None if cpu else torch.device(device)
        self.reset_host()

    @staticmethod
    def allocate_send(device: str):
        """The buffer one collective sends per step, ``[digest, log head]`` (int64 ``[2]``):
        the monitor's log takes word 1 as its head, so the head travels without a copy."""
        return runtime.empty((WORDS,), np.int64, device, fill=0)

    # ------------------------------------------------------------------ per step
    def step_digest(self, groups, *, input_ids, positions, locs) -> Digest:
        """The :class:`Digest` of a monitor's step (see :func:`step_rows`) into ``send[0]``:
        the monitor runs it inside its last write's launch (``ops.write(digest=)``)."""
        return self.digest(step_rows(groups, input_ids=input_ids, positions=positions, locs=locs))

    def digest(self, rows: list[DigestRow]) -> Digest:
        """The :class:`Digest` of ``rows`` into ``send[0]``, kept per set of arrays."""
        key = _key(rows)
        d = self._digests.get(key)
        if d is None:
            d = self._digests[key] = Digest(rows, out=self.send[:1])
            if len(self._digests) > _DIGESTS_KEPT:
                old = self._digests.popitem(last=False)[1]
                if self._keepalive is not None:
                    self._keepalive.hold(old)  # a queued launch may still read its descriptor table
        else:
            self._digests.move_to_end(key)
        return d

    def exchange(self, ptr) -> None:
        """Gather ``[digest, log head]`` from every rank and compare, on stream ``ptr`` (the CPU:
        at once), after the step's digest and every append of the step to the log."""
        self._exchange(ptr)
        self._compare.run(ptr)

    def _exchange(self, ptr) -> None:
        if ptr is None:
            self._gather(self._recv_t, self._send_t, group=self.group)
            return
        torch = self._torch
        with torch.cuda.device(self._torch_device):
            if int(torch.cuda.current_stream().cuda_stream) == int(ptr):  # e.g. a capture on PyTorch's stream
                self._gather(self._recv_t, self._send_t, group=self.group)
                return
            s = self._streams.get(ptr)
            if s is None:
                # Handle 0 is the legacy default stream, which PyTorch has as its default stream.
                s = self._streams[ptr] = (torch.cuda.default_stream(self._torch_device) if int(ptr) == 0 else
                                          torch.cuda.ExternalStream(int(ptr), device=self._torch_device))
            with torch.cuda.stream(s):
                self._gather(self._recv_t, self._send_t, group=self.group)

    # ------------------------------------------------------------------ poll
    def reset_host(self) -> None:
        """Forget what polls have seen (the device state and the log were reset too)."""
        self._prev = np.zeros(len(AGREE_STATE_FIELDS), dtype=np.int64)
        self._pending: list = []  # (ring index, Violation) logged after the latest agreement
        self._seen = 0  # ring rows handed to release() so far

    def reset(self, ptr) -> None:
        """Zero the device state (stream-ordered) and the host's view of it."""
        with runtime.on_stream(self.device, ptr):
            self.state.fill(0)
        self.reset_host()

    def release(self, rows: list[Violation], snapshot: np.ndarray) -> list[Violation]:
        """What a poll reports, the same decision on every rank.

        ``rows`` are the next rows of this rank's ring (mapped to requests), ``snapshot``
        the agreement state copied with them. Rows before the latest agreement's boundary
        are released; later ones wait for the agreement that counts them. If the group's
        tally grew since the previous poll and this rank releases nothing, a group notice
        stands in for the rows other ranks logged.
        """
        self._pending += [(self._seen + j, v) for j, v in enumerate(rows)]
        self._seen += len(rows)
        boundary = int(snapshot[_AT["agreed_head"]])
        out = [v for i, v in self._pending if i < boundary]
        self._pending = [(i, v) for i, v in self._pending if i >= boundary]
        new = snapshot - self._prev
        self._prev = np.array(snapshot, dtype=np.int64)
        group_new, own_new, div_new = (int(new[_AT[f]]) for f in ("group_rows", "own_rows", "divergences"))
        if (group_new > 0 or div_new > 0) and not out:
            # Every rank appended the round's divergence rows: none released here means the ring was full.
            out = [Violation.group_notice(other_rows=max(group_new - own_new, 0), unheld_divergences=max(div_new, 0),
                                          agreement_step=int(snapshot[_AT["agreement_steps"]]))]
        return out

    @staticmethod
    def stats(snapshot: np.ndarray) -> dict:
        """``group_violations`` (rows the group logged: every rank's checks' plus the divergence
        rows, each once), ``divergences``, ``agreement_steps`` from a host copy of the state."""
        return {"group_violations": int(snapshot[_AT["group_rows"]]) + int(snapshot[_AT["divergences"]]),
                "divergences": int(snapshot[_AT["divergences"]]),
                "agreement_steps": int(snapshot[_AT["agreement_steps"]])}
