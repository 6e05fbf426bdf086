"""A paged KV cache held in JAX arrays, watched by the canary (zero copy in).

The engine keeps a vLLM-style ``block_table`` and a K pool ``[layers, pages,
page_size, dim]`` as JAX arrays and updates them functionally (each update makes a
new array). The canary, its plans and its log belong to the library; it only
reads the JAX arrays, through DLPack, and ``rebind`` hands it each new version
before the step that reads it. After a few steps the table's page entry of one
request is repointed at another request's page; the chain check catches it.

    python examples/jax_paged_cache.py --device cpu   # NumPy backend, CPU JAX
    python examples/jax_paged_cache.py                # CUDA (JAX and CuPy share the GPU)
"""
from __future__ import annotations

import argparse
import os
import sys

PAGE, PAGES, LAYERS, DIM = 4, 32, 2, 8  # DIM float32 = 32 bytes per token per layer
ROWS, WIDTH = 4, 8  # request-table rows (row 0: padding) x pages per request


def print_incidents(mon) -> None:
    """Each incident once: every later step that reads the broken slot finds it again, and the
    monitor folds those rows into one incident (first step, rows, last step)."""
    for incident in mon.incidents:
        print("caught:", incident)


def run(device: str, steps: int = 8, inject_at: int = 4) -> int:
    if device == "cpu":
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    else:
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave GPU memory to CuPy too
    import jax
    import jax.numpy as jnp
    import numpy as np

    import kvcanary_cupy as kc

    if device != "cpu" and not any(d.platform == "gpu" for d in jax.devices()):
        print("JAX sees no GPU (CPU-only jax?): run with --device cpu", file=sys.stderr)
        return 2

    @jax.jit
    def write_kv(pool, pages, offs, tokens, positions):
        """The model's store: a value per (token, position, layer) into each token's page slot."""
        lay = jnp.arange(LAYERS, dtype=jnp.float32)[:, None, None]
        dim = jnp.arange(DIM, dtype=jnp.float32)[None, None, :]
        vals = jnp.sin(tokens[None, :, None] * 0.37 + positions[None, :, None] * 0.11 + lay + dim * 0.05)
        return pool.at[:, pages, offs, :].set(vals)

    table = jnp.zeros((ROWS, WIDTH), jnp.int32)
    pool = jnp.zeros((LAYERS, PAGES, PAGE, DIM), jnp.float32)
    mon = kc.KvCanary(num_slots=PAGES * PAGE, block_table=table, page_size=PAGE, max_batch=3,
                      device="cpu" if device == "cpu" else "cuda",
                      real_kv=kc.RealKvSource(pool, page_size=PAGE, bytes_per_token=DIM * 4, layer_axis=True),
                      real_kv_mode=kc.RealKvMode.ALL, policy=lambda found: None)

    rng = np.random.default_rng(0)
    free_pages = list(range(PAGES - 1, 0, -1))  # page 0 holds slot 0 (padding)
    reqs = {1: [int(t) for t in rng.integers(1, 1000, 6)], 2: [int(t) for t in rng.integers(1, 1000, 7)],
            3: [int(t) for t in rng.integers(1, 1000, 5)]}
    pages = {r: [] for r in reqs}
    cached = {r: 0 for r in reqs}  # positions written
    names = {1: "alice", 2: "bob", 3: "carol"}
    found = []
    for t in range(steps):
        rows = sorted(reqs)
        ext = [len(reqs[r]) - cached[r] for r in rows]  # first step: the prompt; then one token
        for r, e in zip(rows, ext):
            while len(pages[r]) * PAGE < cached[r] + e:
                p = free_pages.pop()
                table = table.at[r, len(pages[r])].set(p)  # a functional update: a new array
                pages[r].append(p)
        if t == inject_at:
            table = table.at[2, 0].set(pages[1][0])  # bug: bob's first page now points at alice's
            print(f"step {t}: bob's first page entry repointed to alice's first page ({pages[1][0]})")
        toks = [tok for r in rows for tok in reqs[r][cached[r]:]]
        poss = [p for r in rows for p in range(cached[r], len(reqs[r]))]
        locs = [pages[r][p // PAGE] * PAGE + p % PAGE for r in rows for p in range(cached[r], len(reqs[r]))]
        ids, pos, loc = (jnp.asarray(a, jnp.int32) for a in (toks, poss, locs))

        table.block_until_ready()
        mon.rebind(block_table=table)  # this step's table: imported zero copy, read, never written
        mon.before_forward(jnp.asarray(rows, jnp.int32), jnp.asarray([cached[r] for r in rows], jnp.int32),
                           jnp.asarray(ext, jnp.int32), request_ids=[names[r] for r in rows])
        pool = write_kv(pool, loc // PAGE, loc % PAGE, ids.astype(jnp.float32), pos.astype(jnp.float32))
        pool.block_until_ready()
        mon.rebind(real_kv=kc.RealKvSource(pool, page_size=PAGE, bytes_per_token=DIM * 4, layer_axis=True))
        mon.after_forward(ids, pos, loc)
        new = mon.poll()
        if new and t < inject_at:
            print("violation on a clean step:", *new, sep="\n  ")
            return 1
        found += new
        for r in rows:
            cached[r] = len(reqs[r])
            reqs[r].append(int(rng.integers(1, 1000)))  # "sample" the next token
    found += mon.poll() + mon.poll()
    print_incidents(mon)
    ok = bool(found) and all(v.request == "bob" for v in found)
    print(f"{mon.stats()['steps']} steps: {'fault caught' if ok else 'FAULT MISSED'}")
    return 0 if ok else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args(argv)
    return run(args.device, steps=args.steps)


if __name__ == "__main__":
    sys.exit(main())
