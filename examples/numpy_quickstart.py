"""Quickstart: the KV canary on a tiny paged cache, on the CPU (NumPy backend).

Allocate the canary and plans, then per step: plan what the step reads and writes,
verify the records it reads, (the model writes K/V,) stamp the records it wrote.
Then break the slot table the way an engine bug would and watch verify catch it.

    python examples/numpy_quickstart.py
"""
import numpy as np

import kvcanary_cupy as kc

# A violation's "expected token -1" means the token id was not checked: these steps pass no
# expected tokens (kc.ExpectedTokens), so verify checks position, chain link (which covers
# the previous token) and, where K/V sources are given, the K/V bytes.
# The engine's slot table: req_to_token[row, position] = KV slot. Row 0 is the padding row.
req_to_token = np.zeros((4, 32), dtype=np.int32)

# What the library owns: one record per slot, the plans, and a violation log.
canary = kc.CanaryBuffer.allocate(num_slots=128, device="cpu")
vplan = kc.VerifyPlan.allocate(capacity=64, max_batch=2, device="cpu")
wplan = kc.WritePlan.allocate(max_batch=2, device="cpu")
log = kc.ViolationLog.allocate(capacity=32, device="cpu")


def step(rows, prefix_lens, extend_lens, tokens, positions, slots):
    kc.plan(vplan, wplan, req_pool_indices=rows, prefix_lens=prefix_lens, extend_lens=extend_lens,
            req_to_token=req_to_token)
    kc.verify(canary, vplan, log=log, tag=kc.LaunchTag.VERIFY)  # checks what this step reads
    # ... the model writes K/V into `slots` here ...
    kc.write(canary, wplan, input_ids=tokens, positions=positions, out_cache_loc=slots, log=log,
             tag=kc.LaunchTag.WRITE)  # stamps what this step wrote


# Step 1: two requests (rows 1 and 2) prefill 4 and 3 tokens.
req_to_token[1, :4] = [10, 11, 12, 13]
req_to_token[2, :3] = [20, 21, 22]
step(np.array([1, 2]), np.array([0, 0]), np.array([4, 3]),
     tokens=np.array([101, 102, 103, 104, 201, 202, 203]), positions=np.array([0, 1, 2, 3, 0, 1, 2]),
     slots=np.array([10, 11, 12, 13, 20, 21, 22]))

# Step 2: both decode one token; verify reads both prefixes.
req_to_token[1, 4], req_to_token[2, 3] = 14, 23
step(np.array([1, 2]), np.array([4, 3]), np.array([1, 1]),
     tokens=np.array([105, 204]), positions=np.array([4, 3]), slots=np.array([14, 23]))
print("clean steps, violations:", log.read())
print("counters:", log.counters())

# An engine bug: request 1's position 2 now points at request 2's slot 21.
req_to_token[1, 2] = 21
req_to_token[1, 5], req_to_token[2, 4] = 15, 24
step(np.array([1, 2]), np.array([5, 4]), np.array([1, 1]),
     tokens=np.array([106, 205]), positions=np.array([5, 4]), slots=np.array([15, 24]))
found = log.read()
for v in found:
    print("caught:", v)
assert found and all(v.batch_row == 0 for v in found), "the corrupted table entry must be caught"

# The same, with the monitor an engine integrates (it owns canary, plans and log).
mon = kc.KvCanary(num_slots=128, req_to_token=req_to_token, max_batch=2, policy="raise")
req_to_token[1, :3] = [30, 31, 32]
mon.before_forward(np.array([1]), np.array([0]), np.array([3]), request_ids=["req-A"])
mon.after_forward(np.array([7, 8, 9]), np.array([0, 1, 2]), np.array([30, 31, 32]))
req_to_token[1, 1] = 11  # bug: position 1 now reads a slot this monitor never stamped
req_to_token[1, 3] = 33
mon.before_forward(np.array([1]), np.array([3]), np.array([1]), request_ids=["req-A"])
try:
    mon.poll()
except kc.KvCanaryError as e:
    print("monitor raised:", e)
    assert e.violations[0].request == "req-A"
else:
    raise SystemExit("the monitor missed the corrupted entry")
