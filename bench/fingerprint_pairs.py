"""How often two changed words leave the fingerprint's lanes as they were.

For each of N random word pairs (random data, the first word at a random
global position below 2^40, the second a random distance up to 2^20 words
after it), three kinds of change are applied to both words and the lane
terms recomputed with the numpy oracle's (`word_terms_reference`):

- one: a single-bit change in each word, bits drawn independently;
- opposite: the same bit in both, 0 -> 1 in one and 1 -> 0 in the other
  (the case a plain sum of the words never sees);
- random: both words replaced by random words.

It prints, for each kind, how many pairs left lane 0, lane 1 and both lanes
unchanged. Run: python bench/fingerprint_pairs.py [--pairs N] [--seed S]
"""

from __future__ import annotations

import argparse

import numpy as np

from resident_trainer.ops.fingerprint import word_terms_reference as terms

M32 = np.uint64(0xFFFFFFFF)


def count(w_i, w_j, v_i, v_j, g_i, g_j) -> tuple[int, int, int]:
    """Pairs whose change (w -> v at both words) left lane 0, lane 1, both unchanged."""
    before = [terms(w_i, g_i), terms(w_j, g_j)]
    after = [terms(v_i, g_i), terms(v_j, g_j)]
    d0 = (after[0][0] + after[1][0] - before[0][0] - before[1][0]) & M32
    d1 = (after[0][1] + after[1][1] - before[0][1] - before[1][1]) & M32
    return int((d0 == 0).sum()), int((d1 == 0).sum()), int(((d0 == 0) & (d1 == 0)).sum())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", type=int, default=1 << 20, help="random word pairs per kind (default 2^20)")
    ap.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    args = ap.parse_args(argv)
    if args.pairs < 1:
        ap.error(f"--pairs must be at least 1, got {args.pairs}")
    rng = np.random.default_rng(args.seed)
    n = args.pairs
    g_i = rng.integers(0, 1 << 40, n, dtype=np.uint64)
    g_j = g_i + rng.integers(1, (1 << 20) + 1, n, dtype=np.uint64)
    w_i = rng.integers(0, 1 << 32, n, dtype=np.uint64)
    w_j = rng.integers(0, 1 << 32, n, dtype=np.uint64)
    one = np.uint64(1)
    b_i = rng.integers(0, 32, n, dtype=np.uint64)
    b_j = rng.integers(0, 32, n, dtype=np.uint64)
    # opposite: bit b set in w_j and clear in w_i, then moved from one to the other
    b = b_i
    o_i, o_j = w_i & ~(one << b), w_j | (one << b)
    kinds = {
        "one": (w_i, w_j, w_i ^ (one << b_i), w_j ^ (one << b_j)),
        "opposite": (o_i, o_j, o_i | (one << b), o_j & ~(one << b)),
        "random": (
            w_i,
            w_j,
            rng.integers(0, 1 << 32, n, dtype=np.uint64),
            rng.integers(0, 1 << 32, n, dtype=np.uint64),
        ),
    }
    print(f"{n} pairs a kind, seed {args.seed}")
    print(f"{'change':<10} {'lane0 kept':>11} {'lane1 kept':>11} {'both kept':>10}")
    for name, (a, c, va, vc) in kinds.items():
        if name == "random":
            same = (va == a) & (vc == c)
            va, vc = va[~same], vc[~same]
            a, c, gi, gj = a[~same], c[~same], g_i[~same], g_j[~same]
        else:
            gi, gj = g_i, g_j
        k0, k1, both = count(a, c, va, vc, gi, gj)
        print(f"{name:<10} {k0:>11} {k1:>11} {both:>10}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
