"""The launch cache of recent native calls: repeated arguments skip validation and packing,
never correctness, and the cache holds nothing past its owner or its bound."""
import gc
import weakref

import numpy as np
import pytest

import kvcanary_cupy as kc
from kvcanary_cupy.launch_cache import LaunchCache

TABLE = np.array([[0] * 8, [11, 12, 13, 14, 15, 16, 17, 18], [21, 22, 23, 24, 25, 26, 27, 28]], dtype=np.int32)


def _plan_args(xp, rows, prefix):
    return dict(req_pool_indices=xp.asarray(rows), prefix_lens=xp.asarray(prefix),
                extend_lens=xp.zeros(len(rows), dtype=xp.int64), req_to_token=xp.asarray(TABLE))


def _slots(vp):
    return vp.host_entries()["slot_indices"].tolist()


def test_repeated_call_sees_new_contents(xp, device):
    vp = kc.VerifyPlan.allocate(capacity=16, max_batch=2, device=device)
    a = _plan_args(xp, [1, 2], [2, 3])
    kc.plan(vp, None, **a)
    assert _slots(vp) == [11, 12, 21, 22, 23]
    a["prefix_lens"][:] = xp.asarray([1, 1])  # the same arrays, new data
    a["req_pool_indices"][:] = xp.asarray([2, 1])
    kc.plan(vp, None, **a)
    assert _slots(vp) == [21, 11]
    assert len(vp.launches) == 1


def test_alternating_input_sets_are_both_kept(xp, device):
    vp = kc.VerifyPlan.allocate(capacity=16, max_batch=2, device=device)
    sets = [_plan_args(xp, [1], [3]), _plan_args(xp, [2, 1], [1, 2])]
    for _ in range(3):
        for s, want in zip(sets, ([11, 12, 13], [21, 11, 12])):
            kc.plan(vp, None, **s)
            assert _slots(vp) == want
    assert len(vp.launches) == 2


def test_new_arguments_are_validated_again(xp, device):
    vp = kc.VerifyPlan.allocate(capacity=16, max_batch=2, device=device)
    a = _plan_args(xp, [1], [3])
    kc.plan(vp, None, **a)
    with pytest.raises(ValueError, match="kvcanary: req_pool_indices: a batch of 3 rows"):
        kc.plan(vp, None, **_plan_args(xp, [1, 1, 1], [3, 3, 3]))
    with pytest.raises(TypeError, match="kvcanary: prefix_lens"):
        kc.plan(vp, None, **dict(a, prefix_lens=xp.asarray([3.0])))
    with pytest.raises(TypeError, match="kvcanary: verify_plan"):
        kc.plan("not a plan", None, **a)


def test_equal_scalars_share_one_entry(xp, device):
    canary = kc.CanaryBuffer.allocate(num_slots=32, device=device)
    vp = kc.VerifyPlan.allocate(capacity=16, max_batch=2, device=device)
    log = kc.ViolationLog.allocate(capacity=8, device=device)
    kc.plan(vp, None, **_plan_args(xp, [1], [0]))
    for tag in (1000, int("1000"), 999 + 1):  # equal values of one type, distinct objects
        kc.verify(canary, vp, log=log, tag=tag)
    assert len(canary.launches) == 1
    kc.verify(canary, vp, log=log, tag=1001)
    assert len(canary.launches) == 2


def test_memo_is_bounded_and_lets_the_oldest_arguments_go(xp, device):
    vp = kc.VerifyPlan.allocate(capacity=16, max_batch=2, device=device)
    sets = [_plan_args(xp, [1], [k % 4]) for k in range(LaunchCache.CAPACITY + 5)]
    first, last = weakref.ref(sets[0]["req_pool_indices"]), weakref.ref(sets[-1]["req_pool_indices"])
    for s in sets:
        kc.plan(vp, None, **s)
    assert len(vp.launches) == LaunchCache.CAPACITY
    del sets, s
    gc.collect()
    assert first() is None  # evicted: its arguments are free
    assert last() is not None  # kept: the next identical call skips validation


def test_calls_go_with_their_canary(xp, device):
    """The memo holds the step's arguments, but not past the canary it lives on."""
    canary = kc.CanaryBuffer.allocate(num_slots=32, device=device)
    vp = kc.VerifyPlan.allocate(capacity=16, max_batch=2, device=device)
    log = kc.ViolationLog.allocate(capacity=8, device=device)
    kc.plan(vp, None, **_plan_args(xp, [1], [2]))
    kc.verify(canary, vp, log=log, tag=1)
    gone = weakref.ref(canary)
    held = weakref.ref(log)
    del canary, log
    gc.collect()
    alive = gone()
    holders = [type(r).__name__ for r in gc.get_referrers(alive)] if alive is not None else []
    assert alive is None, f"the canary outlived its memo; held by {holders}"
    del alive
    assert held() is None


def test_foreign_inputs_are_not_kept():
    torch = pytest.importorskip("torch")
    vp = kc.VerifyPlan.allocate(capacity=16, max_batch=2)
    kc.plan(vp, None, req_pool_indices=torch.tensor([1]), prefix_lens=torch.tensor([2]),
            extend_lens=torch.tensor([0]), req_to_token=torch.from_numpy(TABLE))
    assert _slots(vp) == [11, 12]
    assert len(vp.launches) == 0
