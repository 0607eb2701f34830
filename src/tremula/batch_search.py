"""How large a batch fits: the lower bound of limits.py first, then plans probed by doubling and bisection.

A batch the bound refuses is never planned (planning one took minutes and gigabytes before failing, issue #11).
"""

from __future__ import annotations

from collections.abc import Callable

from tremula import limits
from tremula.frontends.rebatch import FixedBatch
from tremula.ir.graph import Graph, model_batch
from tremula.pipeline import Progress, canonical, keep_fastest, plan_graph, price_plan, resolve_dtype

MAX_AUTO_BATCH = 4096


def _needs(graph: Graph, dt: str, weights: str = "resident") -> tuple[limits.Need, limits.Need]:
    """The lower bounds (limits.py) of `graph` on the chip at `dt` and on the host; unless every weight must be
    resident, the chip's counts the repeated layers' weights as streaming leaves them (limits.needs)."""
    g = canonical(graph)
    b = model_batch(graph)
    return limits.needs(g, dt, b, stream=weights != "resident"), limits.needs(g, None, b)


def _caps(chip) -> tuple[int, int | None]:
    return limits.chip_capacity(chip), limits.host_memory_budget()


def _memory_names(chip) -> tuple[str, str]:
    return (f"the {chip.tiles} x {chip.sram_bytes_per_tile:,} bytes of SRAM of {chip.name}",
            f"the {limits.HOST_FRACTION:.0%} of this host's memory tremula allows itself")


def bound_limit(build: Callable[[int | None], Graph], chip, dt: str, host_only: bool = False,
                weights: str = "resident") -> int:
    """The largest batch the lower bound allows on the chip and the host (0: not batch 1), from the model built
    at batches 1 and 2; a model that cannot be built at another batch gives no limit."""
    try:
        g1, g2 = build(1), build(2)
    except FixedBatch:
        return limits.UNBOUNDED
    (c1, h1), (c2, h2) = _needs(g1, dt, weights), _needs(g2, dt, weights)
    cap, host = _caps(chip)
    best = limits.largest_batch(c1, c2, cap) if not host_only else limits.UNBOUNDED
    if host is not None:
        best = min(best, limits.largest_batch(h1, h2, host))
    return best


def refuse_oversize(build, graph: Graph, chip, dt: str, what: str | None = None, host_only: bool = False,
                    weights: str = "resident") -> None:
    """Raise limits.TooBig when `graph` cannot fit by the lower bound, with the largest batch that could; planning
    a batch that cannot fit took minutes and gigabytes before failing (issue #11)."""
    chip_need, host_need = _needs(graph, dt, weights)
    cap, host = _caps(chip)
    on_chip, on_host = _memory_names(chip)
    if not host_only and chip_need.total > cap:
        need, limit, memory = chip_need, cap, on_chip
    elif host is not None and host_need.total > host:
        need, limit, memory = host_need, host, on_host
    else:
        return
    b = model_batch(graph)
    max_b = None
    if b == 1:
        max_b = 0
    elif build is not None and b is not None:
        max_b = bound_limit(build, chip, dt, host_only=host_only, weights=weights)
        max_b = min(max_b, b - 1)
    raise limits.refusal(need, limit, what or f"{graph.name} at batch {b}", max_b, memory, samples=host_only)


def fits_at(build: Callable[[int], Graph], chip, dtype: str, batch: int,
            scales: dict[str, int] | None = None, shared_only: bool = False,
            partials: str = "float", rates: dict[int, float] | None = None,
            plans: dict | None = None, weights: str = "auto") -> tuple[bool, bool]:
    """(whether a plan fits, whether only shared-layer plans can: none fitting, or the one that fits shares).
    A batch over the lower bound (limits.py) is answered without planning. `rates`: a plan that fits has its
    modelled samples/s put there by batch (its Program priced as the compile prices it); `plans` (with rates):
    the fastest plan so far is kept there whole (pipeline.keep_fastest), for the compile to reuse."""
    graph = build(batch)
    (on_chip, on_host), (cap, host) = _needs(graph, dtype, weights), _caps(chip)
    if on_chip.total > cap or (host is not None and on_host.total > host):
        return False, True
    g, state, mp, live, reserved = plan_graph(graph, chip, dtype, scales=scales, shared_only=shared_only,
                                              partials=partials, weights=weights)
    if mp.fits and rates is not None:
        priced = price_plan(g, state, mp, live, reserved, chip, dtype, batch, shared_only)
        rates[batch] = priced.rate
        if plans is not None:
            keep_fastest(plans, batch, priced)
        priced = None
    return mp.fits, shared_only or not mp.fits or getattr(state, "share_layers", False)


def find_max_batch(build: Callable[[int], Graph], chip, dtype: str = "fp32", limit: int = MAX_AUTO_BATCH,
                   progress: Progress | None = None, scales: dict[str, int] | None = None,
                   one_fits: bool | None = None, found: dict | None = None, partials: str = "float",
                   weights: str = "auto") -> int:
    """The largest batch whose plan fits (0 if batch 1 does not), by doubling then bisection; planner only. Fitting
    is not strictly monotone in the batch (splits and budgets change with it), so this is the largest the search
    finds, and every batch it returns has a plan that fits.

    Once plans without shared layers fail at some batch, larger batches try only shared-layer plans: the others
    grow with the batch (SigLIP so400m's reached 23 GB of host memory at batch 16) and did not fit at a smaller one.
    `found["shared_from"]` is then that batch, and `found["rates"]` the modelled samples/s of every batch planned
    that fits (batch 1's too when the caller passes them in), which compile_model's --batch auto chooses among; with
    `found["plans"]` (a dict the caller puts there) the fastest of those plans is kept whole, for the compile to reuse.

    FP8 scales change no byte of a plan and no choice in it, so the search plans with `scales` (or placeholders);
    only a shared layer's call cycles move with them, by the scale fields it patches (1,212 of 56.8 M cycles for
    SigLIP so400m fp8 at batch 8 between two sets of weights). `one_fits`:
    the caller already planned batch 1. The search goes no higher than the lower bound allows (limits.py), so an
    impossible batch is never planned."""
    dt = resolve_dtype(dtype)
    if dt == "fp8" and scales is None:
        from tremula.passes.precision import activation_casts, fp8_linear_casts

        scales = {n.name: 0 for n in activation_casts(fp8_linear_casts(canonical(build(1))))}
    limit = min(limit, bound_limit(build, chip, dt, weights=weights))
    if limit < 1:
        return 0
    probes = 0
    rates = found.setdefault("rates", {}) if found is not None else None
    plans = found.get("plans") if found is not None else None

    shared_from = limit + 1  # smallest batch at which plans without shared layers failed

    def ok(b: int) -> bool:
        nonlocal probes, shared_from
        probes += 1
        if progress:
            progress("batch search", probes, probes + 1)
        fits, shared = fits_at(build, chip, dt, b, scales, shared_only=b >= shared_from, partials=partials,
                               rates=rates, plans=plans, weights=weights)
        if shared:
            shared_from = min(shared_from, b)
        return fits

    if not (one_fits if one_fits is not None else ok(1)):
        return 0
    lo, hi = 1, 2
    while hi <= limit and ok(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid
    if found is not None and shared_from <= lo:
        found["shared_from"] = shared_from
    return lo
