"""The record format: hash constants, vectorized splitmix64 / mix3, chain helpers."""
import subprocess
import sys
import warnings

import numpy as np
import pytest
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
            "kc.mix3(2**64 - 1, -1, 2**63 - 1); kc.splitmix64(2**64 - 1); kc.chain_links([1, 2], [0, 1]); kc.chain_links([1, 2], [0, 1], chain='sglang');"
            "kc.next_link(np.full((3, 4), -1, np.int64)); kc.scan_term(-1, -1)")
    r = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kc.splitmix64(np.full(8, M64, dtype=np.uint64))


def test_sglang_chain_links_follow_the_chain_rule():
    tokens, positions = [11, 12, 13], [0, 1, 2]
    links = kc.chain_links(tokens, positions, chain="sglang")
    assert int(links[0]) == kc.ANCHOR_HASH
    assert int(links[1]) == mix3_int(kc.ANCHOR_HASH, 11, 0)
    assert int(links[2]) == mix3_int(int(links[1]), 12, 1)
    rec = kc.make_records(tokens, positions, fingerprints=[7, 8, 9], chain="sglang")
    assert rec.dtype == np.int64 and rec.shape == (3, 4)
    assert rec[:, fmt.FIELD_LINK].view(np.uint64).tolist() == [int(x) for x in links]
    assert int(kc.next_link(rec[1], chain="sglang")) == int(links[2])


P61 = (1 << 61) - 1
DESIGN_TOKENS = [101, 202, 303, 404, 505]


def test_scan_constants_and_check_values():
    assert kc.P61 == P61
    assert kc.SCAN_ANCHOR == kc.ANCHOR_HASH % P61 == 0x1E7FAE23A9A1B71C
    assert kc.SCAN_MUL == splitmix64_int(2) % P61 == 0x1BD238973A2B1490
    assert int(kc.scan_term(101, 0)) == 0x0D22AFD540D59970
    assert int(kc.scan_term(-1, -1)) == 0x16BDF7544574C9D1
    assert kc.scan_term(np.array([101, -1]), np.array([0, -1])).tolist() == [0x0D22AFD540D59970, 0x16BDF7544574C9D1]


@pytest.mark.parametrize("chain, links, successor", [
    ("scan", [0x1E7FAE23A9A1B71C, 0x14E8C713DBA50CE1, 0x0A9333D9FEA2265B, 0x1F7502F4DBB7EC43, 0x181F010CDBD4805A],
     0x1DF4FFAAB78C4A63),
    ("sglang", [0xDE7FAE23A9A1B716, 0x542FE5061275A6AB, 0x9890D56BDE53142E, 0x5213C65EEE8A1DD1, 0xC749AFFE5A5A9634],
     0x3A650FCC4023CD13),
])
def test_published_check_values_of_both_chains(chain, links, successor):
    rec = kc.make_records(DESIGN_TOKENS, range(5), chain=chain)
    assert rec[:, fmt.FIELD_LINK].view(np.uint64).tolist() == links
    assert int(kc.next_link(rec[4], chain=chain)) == successor
    assert kc.next_link(rec, chain=chain)[:4].tolist() == links[1:]


def test_scan_successor_is_the_closed_form():
    # SCAN_MUL^5 * SCAN_ANCHOR + sum_k scan_term(t_k, k) * SCAN_MUL^(4-k), mod P61
    want = pow(kc.SCAN_MUL, 5, P61) * kc.SCAN_ANCHOR
    want += sum(int(kc.scan_term(t, k)) * pow(kc.SCAN_MUL, 4 - k, P61) for k, t in enumerate(DESIGN_TOKENS))
    rec = kc.make_records(DESIGN_TOKENS, range(5))
    assert int(kc.next_link(rec[4])) == want % P61


def test_scan_next_link_reads_any_uint64_link():
    # A link written by another kind may exceed P61: it is reduced first.
    rec = np.array([[7, 3, -1, 0]], dtype=np.int64)
    want = (kc.SCAN_MUL * ((2**64 - 1) % P61) + int(kc.scan_term(7, 3))) % P61
    assert int(kc.next_link(rec[0])) == want
    rng = np.random.default_rng(0)
    recs = rng.integers(-2**63, 2**63 - 1, size=(500, 4), dtype=np.int64)
    got = kc.next_link(recs)
    for r, g in zip(recs, got):
        u = int(r[2]) & M64
        assert int(g) == (kc.SCAN_MUL * (u % P61) + int(kc.scan_term(int(r[0]), int(r[1])))) % P61


def test_chain_kind_is_checked():
    with pytest.raises(ValueError, match="kvcanary: chain: expected one of 'scan', 'sglang', got 'v3'"):
        kc.make_records([1], [0], chain="v3")
    with pytest.raises(ValueError, match="kvcanary: chain"):
        kc.CanaryBuffer.allocate(num_slots=4, chain="SCAN")
    assert kc.CanaryBuffer.allocate(num_slots=4).chain == "scan"
    assert kc.CanaryBuffer.allocate(num_slots=4, chain="sglang").chain == "sglang"


def test_fold_and_combine():
    words = np.array([[1, 2, 3, 4]], dtype=np.uint64)
    acc = 0
    for w in (1, 2, 3, 4):
        acc = splitmix64_int(acc ^ w)
    assert int(fmt.fold_chunks(words)[0]) == acc
    f1, f2 = np.array([5], np.uint64), np.array([9], np.uint64)
    assert int(fmt.combine_folds([f1, f2])[0]) == splitmix64_int(splitmix64_int(5) ^ 9)


def test_fold_chunks_folds_the_last_axis_of_every_layer_alike():
    layers = np.random.default_rng(3).integers(0, 2**63, (3, 5, 4)).astype(np.uint64)  # [layers, slots, words]
    got = fmt.fold_chunks(layers)
    assert got.shape == (3, 5)
    for i in range(3):
        for j in range(5):
            acc = 0
            for w in layers[i, j]:
                acc = splitmix64_int(acc ^ int(w))
            assert int(got[i, j]) == acc


P61_EDGES = st.sampled_from([0, 1, 2, (1 << 32) - 1, 1 << 32, (1 << 61) - 2, (1 << 60), (1 << 61) - 3])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.one_of(P61_EDGES, st.integers(0, (1 << 61) - 2)),
                          st.one_of(P61_EDGES, st.integers(0, (1 << 61) - 2))), min_size=1, max_size=16))
def test_mulmod61_matches_python_ints(pairs):
    a = np.array([x for x, _ in pairs], dtype=np.uint64)
    b = np.array([y for _, y in pairs], dtype=np.uint64)
    assert [int(v) for v in fmt.mulmod61(a, b)] == [(x * y) % P61 for x, y in pairs]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.sampled_from([0, P61 - 1, P61, P61 + 1, 2 * P61, M64, M64 - 7]), st.integers(0, M64)),
                min_size=1, max_size=16))
def test_reduce61_matches_python_ints(xs):
    got = fmt.reduce61(np.array(xs, dtype=np.uint64))
    assert [int(v) for v in got] == [x % P61 for x in xs]


def test_splitmix64_leaves_its_input_alone():
    x = np.arange(5, dtype=np.uint64)
    kc.splitmix64(x)
    kc.mix3(x, x.view(np.int64), x.view(np.int64))
    assert x.tolist() == [0, 1, 2, 3, 4]
    assert kc.splitmix64(np.uint64(1)).shape == () and int(kc.splitmix64(np.array(1))) == 0x5692161D100B05E5


def test_mulmod61_at_the_ends_of_the_range():
    # Products that are 1, 2 and P61 - 1 mod P61: each factor times a multiple of its inverse.
    a = [3, 0x1BD238973A2B1490, (1 << 61) - 2, 1 << 40, 12345678901234567]
    pairs = [(x, (k * pow(x, -1, P61)) % P61) for x in a for k in (1, 2, P61 - 1)]
    got = fmt.mulmod61(np.array([x for x, _ in pairs], np.uint64), np.array([y for _, y in pairs], np.uint64))
    assert [int(v) for v in got] == [(x * y) % P61 for x, y in pairs]
