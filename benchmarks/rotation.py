"""Would a rotation (compute-shift) matmul beat the planner's gather + reduce-scatter? Prices both with the one cost
model (target/cost_terms.py) for every distinct matmul of a compiled model and prints a table.

The planner's strategies (plan/strategies.choose_linear) cut each Linear over a pm x pn x pk grid of tiles: each tile
gathers its rows' K slice of x (multicast to the pn tiles that share it), holds or receives one weight block, and K
parts are summed by a reduce-scatter. A rotation keeps an output block on each tile of a q x q grid and, in q rounds,
receives one block of x and one of the weights per round, adding each product into its partial sums (Cannon's
algorithm; T10's compute-shift is its per-operator form). The rotation is priced here as favourably as it can be:
the weights' initial skew is taken as done at load time (they are constants), x's as one exchange, and the best q is
taken. Its per-tile receive is (M K + K N) / q bytes over q rounds and q syncs; the 3-D grid's is about
M K / (pm pk) + K N / (pn pk) (streamed weights) plus its partials, with pm pn pk up to every tile: on 1,472 tiles a
grid's blocks are smaller than a q = 38 rotation's, and its one exchange pays one sync.

    python benchmarks/rotation.py [MODEL --dtype D --batch B]   (default: ViT-B/16 fp16 b8, BERT-base fp16 b16,
                                                                 SigLIP so400m fp8 b8)
"""

from __future__ import annotations

import argparse
import math
import re

import numpy as np

import first_compile

first_compile.cache_off()

from tremula.compiler import compile_model
from tremula.numerics.fp8 import is_fp8
from tremula.plan.strategies import cdiv
from tremula.target import cost_terms
from tremula.target.chip import load_chip

DEFAULT = (("vit-base-patch16-224", "fp16", 8), ("bert-base-uncased", "fp16", 16),
           ("siglip-so400m-patch14-384", "fp8", 8))


def rotation(chip, m: int, k: int, n: int, dtype: str, wdtype: str, partials: str) -> tuple[int, int, int, int]:
    """(cycles, q, bytes a tile receives, bytes a tile holds) of the cheapest q x q rotation of x[m, k] @ w[k, n]."""
    isz, wsz = np.dtype(dtype).itemsize, np.dtype(wdtype).itemsize
    osz = 2 if is_fp8(dtype) or partials == "half" else 4  # partial sums held across rounds
    sync = cost_terms.sync_cycles(chip)
    best = None
    for q in range(2, math.isqrt(chip.tiles) + 1):
        mb, kb, nb = cdiv(m, q), cdiv(k, q), cdiv(n, q)
        a, b = mb * kb * isz, kb * nb * wsz
        cycles = cost_terms.exchange_cycles(chip, a, a) + sync  # x's initial skew (the weights': at load time)
        for r in range(q):
            cycles += cost_terms.exchange_cycles(chip, a + b, a + b) + sync
            cycles += cost_terms.matmul_cycles(chip, mb, kb, nb, dtype, partials, accumulate=r > 0, weights=True)
        cand = (cycles, q, q * (a + b), 2 * (a + b) + mb * nb * osz)  # (double buffers for the next round's blocks)
        best = cand if best is None or cand < best else best
    return best


def chosen(strategy: str) -> int | None:
    """The planner's own price of the strategy it chose (the first estimate in its description)."""
    got = re.search(r"~(\d+) cycles", strategy)
    return int(got.group(1)) if got else None


def table(model: str, dtype: str, batch: int) -> None:
    chip = load_chip("c600")
    res = compile_model(model, chip, batch, dtype)
    g = res.graph
    seen: dict[tuple, list[str]] = {}
    for node in g.nodes:
        if node.op not in ("Linear", "LinearFp8") or (node.name or node.outputs[0]) not in res.strategies:
            continue
        x, w = node.inputs[0], node.inputs[1]
        m = int(np.prod(g.types[x].shape[:-1]))
        key = (m, g.types[x].shape[-1], g.types[node.outputs[0]].shape[-1], g.types[x].dtype, g.types[w].dtype,
               "half" if node.attrs.get("partials") == "half" or is_fp8(g.types[x].dtype) else "float")
        seen.setdefault(key, []).append(node.name or node.outputs[0])
    print(f"\n{model} {dtype} b{batch} on {chip.name} ({chip.tiles} tiles): {res.cycles:,} cycles")
    print(f"{'matmul (first of its shape)':48s} {'n':>3s} {'M x K x N':>18s} {'chosen':>9s} "
          f"{'rotation':>9s} {'q':>3s} {'x':>5s}  {'rot. recv/tile':>14s} {'rot. holds':>10s}")
    for (m, k, n, dt, wdt, partials), names in seen.items():
        mine = chosen(res.strategies[names[0]])
        rot, q, recv, holds = rotation(chip, m, k, n, dt, wdt, partials)
        ratio = f"{rot / mine:5.2f}" if mine else "    -"
        print(f"{names[0][-48:]:48s} {len(names):3d} {f'{m} x {k} x {n}':>18s} {mine or 0:9,d} {rot:9,d} {q:3d} "
              f"{ratio}  {recv:14,d} {holds:10,d}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--dtype", default="fp16")
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    for model, dtype, batch in ([(args.model, args.dtype, args.batch)] if args.model else DEFAULT):
        table(model, dtype, batch)


if __name__ == "__main__":
    main()
