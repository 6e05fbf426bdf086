"""The record format: hash constants, vectorized splitmix64 / mix3, chain helpers."""
import subprocess
import sys
import warnings

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcanary_cupy as kc
from kvcanary_cupy import format as fmt
from tests.workloads import mix as mix3_int  # scalar models on Python ints
from tests.workloads import sm64 as splitmix64_int

M64 = (1 << 64) - 1


def test_published_constants():
    assert int(kc.splitmix64(1)) == 0x5692161D100B05E5
    assert kc.ANCHOR == 0xC0FFEE1234567890
    assert kc.ANCHOR_HASH == 0xDE7FAE23A9A1B716
    assert int(kc.splitmix64(kc.ANCHOR)) == kc.ANCHOR_HASH


def test_fail_reason_bits_and_words():
    assert [int(b) for b in (kc.FailReason.CHAIN, kc.FailReason.POSITION, kc.FailReason.REAL_KV,
                             kc.FailReason.WRITE_TOKEN, kc.FailReason.WRITE_POSITION, kc.FailReason.TOKEN,
                             kc.FailReason.SLOT_OUT_OF_RANGE)] == [1, 2, 4, 8, 16, 32, 64]
    assert (kc.FailReason.CHAIN | kc.FailReason.REAL_KV).describe() == "chain+real_kv"
    assert kc.FailReason(0).describe() == "none"
    assert [int(m) for m in kc.RealKvMode] == [0, 1, 2]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-(1 << 63), M64), min_size=1, max_size=20))
def test_splitmix64_matches_scalar_model(xs):
    arr = np.array([x & M64 for x in xs], dtype=np.uint64)
    got = kc.splitmix64(arr)
    assert got.dtype == np.uint64
    assert [int(v) for v in got] == [splitmix64_int(x) for x in xs]
    signed = arr.view(np.int64)
    assert np.array_equal(kc.splitmix64(signed), got)  # int64 input is reinterpreted, not converted


@settings(max_examples=200, deadline=None)
@given(st.integers(0, M64), st.integers(-(1 << 63), (1 << 63) - 1), st.integers(-(1 << 63), (1 << 63) - 1))
def test_mix3_matches_scalar_model(a, b, c):
    assert int(kc.mix3(a, b, c)) == mix3_int(a, b, c)
    v = kc.mix3(np.array([a], np.uint64), np.array([b], np.int64), np.array([c], np.int64))
    assert int(v[0]) == mix3_int(a, b, c)


def test_minus_one_is_all_ones():
    assert int(kc.mix3(5, -1, -1)) == mix3_int(5, M64, M64)


def test_no_overflow_warnings_under_error_filter():
    code = ("import numpy as np, kvcanary_cupy as kc;"
            "kc.splitmix64(np.arange(1000, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15));"
            "kc.mix3(2**64 - 1, -1, 2**63 - 1); kc.splitmix64(2**64 - 1); kc.chain_links([1, 2], [0, 1])")
    r = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kc.splitmix64(np.full(8, M64, dtype=np.uint64))


def test_chain_links_follow_the_chain_rule():
    tokens, positions = [11, 12, 13], [0, 1, 2]
    links = kc.chain_links(tokens, positions)
    assert int(links[0]) == kc.ANCHOR_HASH
    assert int(links[1]) == mix3_int(kc.ANCHOR_HASH, 11, 0)
    assert int(links[2]) == mix3_int(int(links[1]), 12, 1)
    rec = kc.make_records(tokens, positions, fingerprints=[7, 8, 9])
    assert rec.dtype == np.int64 and rec.shape == (3, 4)
    assert rec[:, fmt.FIELD_LINK].view(np.uint64).tolist() == [int(x) for x in links]
    assert int(kc.next_link(rec[1, 2].view(np.uint64), 12, 1)) == int(links[2])


def test_fold_and_combine():
    words = np.array([[1, 2, 3, 4]], dtype=np.uint64)
    acc = 0
    for w in (1, 2, 3, 4):
        acc = splitmix64_int(acc ^ w)
    assert int(fmt.fold_chunks(words)[0]) == acc
    f1, f2 = np.array([5], np.uint64), np.array([9], np.uint64)
    assert int(fmt.combine_folds([f1, f2])[0]) == splitmix64_int(splitmix64_int(5) ^ 9)
