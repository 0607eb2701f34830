"""How large a batch fits: the lower bound of limits.py first, then plans probed by doubling and bisection.

A batch the bound refuses is never planned (planning one took minutes and gigabytes before failing, issue #11).
"""

from __future__ import annotations

from collections.abc import Callable

from tremula import limits
from tremula.beside import beside
from tremula.frontends.rebatch import FixedBatch
from tremula.ir.graph import Graph, model_batch
from tremula.pipeline import (
    Progress,
    canonical,
    plan_fullness,
    plan_graph,
    plan_rate,
    resolve_dtype,
)
from tremula.plan.plan import Plan, recipe_of

MAX_AUTO_BATCH = 4096
# How full a tile a guess's plan must be for the search to try the batch after it next (find_max_batch): a plan this
# close to full is at the edge the line aimed for; one further from it says the line overestimated the growth there,
# and a new line from it guesses better than a step of one (BERT-base fp16: 137 at 96.0 %, 145 at 98.4 % each took a
# step to 138 and 146 that fitted too). A search heuristic, not a chip fact.
NEAR_FULL = 0.99
# How many of the batches a search ranks fastest (each plan grown one step) --batch auto grows fully before it
# chooses (compiler.py): one step does not rank them as the full growth does. BERT-base fp16 on a C600: batch 128 at
# 5,755 samples/s and 64 at 5,690 after a step, 5,900 and 6,058 grown fully; SigLIP so400m fp8: batch 8 at 275.6 and
# 4 at 273.2, then 302.7 and 281.2. Each costs up to nine lowerings more. A search heuristic, not a chip fact.
AUTO_GROWN = 2


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


def placeholder_scales(graph: Graph) -> dict[str, int]:
    """FP8 activation scales to plan with when none are calibrated (they change no choice of a plan): each cast its
    own, k % 61 - 30 for the k-th, so that the same cast of two layers of a run (fewer than 61 casts a layer, 61
    layers) never has the same scale, and a shared layer patches every scale field that calibrated scales could make
    it patch (plan/share.py): a plan that fits with these fits with calibrated ones. Not the other way: calibrated
    scales often repeat from layer to layer; the fullest tile of SigLIP so400m fp8's shared plan at batch 10 holds
    27.1 KB of vertex state with these, 12.1 KB with calibrated scales, and 7.7 KB with all zeros (the placeholders
    before, which patched nothing: a plan could fit with them and not with calibrated scales)."""
    from tremula.passes.precision import activation_casts, fp8_linear_casts

    return {n.name: k % 61 - 30 for k, n in enumerate(activation_casts(fp8_linear_casts(canonical(graph))))}


def zero_scales(graph: Graph) -> dict[str, int]:
    """FP8 activation scales of all zeros, for planning beside the calibration: a shared layer's call patches none of
    them, so a plan holds at most the bytes it holds with calibrated scales (compiler.py plans again with those)."""
    return {k: 0 for k in placeholder_scales(graph)}


def fits_at(build: Callable[[int], Graph], chip, dtype: str, batch: int,
            scales: dict[str, int] | None = None, shared_only: bool = False,
            partials: str = "float", rates: dict[int, float] | None = None,
            plans: dict | None = None, weights: str = "auto", from_budget: int = 0,
            budget: list[int] | None = None, grow: bool = False, level_from: bool = False,
            growths: GrowthsBeside | None = None) -> tuple[bool, bool, float | None]:
    """(whether a plan fits, whether only shared-layer plans can: none fitting, or the one that fits shares, how
    full (pipeline.plan_fullness) the fitting plan is, else the least full plan tried; None when not planned). A
    batch over the lower bound (limits.py) is answered without planning, and one no budget fits without lowering
    its least full plan again (plan_graph's lowest_peak=False). `rates`: a plan that fits has its modelled
    samples/s put there by batch (priced from its lowering state as the compile prices its Program); `plans` (with
    rates): the AUTO_GROWN fastest plans so far (the larger batch on a tie) are kept there whole, batch -> its
    Plan, for the compile to grow on (pipeline.grown_on). from_budget /
    budget / level_from: as in pipeline.plan_graph (`budget` gets nothing when the batch is not planned). grow: a
    plan that fits is grown one step, its operand budget into the bytes it left free (pipeline.plan_graph's `grow`,
    without the ops' own budgets; growable), and its rate is the grown plan's; how full it is stays the plan's
    before. growths: the growth is made beside the search (GrowthsBeside), which puts the grown plan's rate into
    `rates` when it is collected; a plan that fits is kept there as its recipe, and in `plans` only when it has none
    (its weights stream)."""
    graph = build(batch)
    (on_chip, on_host), (cap, host) = _needs(graph, dtype, weights), _caps(chip)
    if on_chip.total > cap or (host is not None and on_host.total > host):
        return False, True, None
    tried: list[float] = []
    plan = plan_graph(graph, chip, dtype, scales=scales, shared_only=shared_only, partials=partials,
                      weights=weights, lowest_peak=False, fullness=tried, from_budget=from_budget, budget=budget,
                      grow=1 if grow else 0, grow_ops=False, grow_when=growable(chip), level_from=level_from,
                      grow_beside=growths.start(batch) if growths is not None else None)
    if plan.fits and rates is not None:
        handed = growths is not None and growths.keep(batch, plan)  # (a growth beside brings its own rate)
        if not handed:
            rates[batch] = plan_rate(plan, chip, dtype, batch)
        if plans is not None and kept_whole(plan, growths):  # the AUTO_GROWN fastest so far (the larger on a tie)
            plans[batch] = plan
            if len(plans) > AUTO_GROWN:
                del plans[min(plans, key=lambda b: (rates[b], b))]
    full = tried[-1] if plan.fits else min(tried)  # (the plan that fitted, before any growth)
    return plan.fits, shared_only or not plan.fits or getattr(plan.state, "share_layers", False), full


class GrowthsBeside:
    """A batch search's one-step growths (fits_at's `grow`), each made in a forked process beside the search while it
    plans the next batch (beside.py), one at a time. A growth decides how the batches rank, not which batch is probed
    next nor how (that is decided on the plans before growth), so the search probes what it probes with the growths
    made in turn, and ranks the batches the same. Each grown plan comes back as its samples/s (into found["rates"])
    and its Recipe with where its growth stopped (found["made"]: batch -> (Recipe or None, Growth or None)), from which
    the compile makes it again (compiler._fastest_grown); so does every other plan that fits (keep). BERT-base fp16
    --batch auto on two cores: its search done at 26-28 s, at 35 s with the growths made in turn; 30-33 s in all
    against 43 s on one core, in one hour of this VM (35-42 against 62 in a slower one; the cores it may use:
    beside.usable_cores). A forked process costs the parent copies of the pages it writes afterwards (6 s of system
    time against 3 on one core), so growths are made beside only where a second core runs them."""

    def __init__(self, chip, dt: str, found: dict):
        self.chip, self.dt = chip, dt
        self.rates, self.made = found.setdefault("rates", {}), found.setdefault("made", {})
        self._pending: tuple[int, Callable[[], tuple]] | None = None

    def start(self, batch: int) -> Callable[[Callable[[], Plan]], None]:
        """plan_graph's grow_beside for the plan of `batch`: the growth it hands over is started beside, once the
        one before it is collected."""
        def hand(grow: Callable[[], Plan]) -> None:
            self.collect()

            def work() -> tuple:
                plan = grow()
                return plan_rate(plan, self.chip, self.dt, batch), recipe_of(plan.state), plan.state.growth

            self._pending = (batch, beside(work, name="tremula-grow", process=True))
        return hand

    def keep(self, batch: int, plan: Plan) -> bool:
        """A plan of `batch` that fits: its recipe kept, unless its growth was handed over (whether it was: that one
        brings its own recipe and rate)."""
        if self._pending is not None and self._pending[0] == batch:
            return True
        self.made[batch] = (recipe_of(plan.state), getattr(plan.state, "growth", None))
        return False

    def collect(self) -> None:
        """Waits for the growth beside, if one runs, and puts what it made in."""
        if self._pending is not None:
            batch, result = self._pending
            self._pending = None
            rate, recipe, growth = result()
            self.rates[batch], self.made[batch] = rate, (recipe, growth)


def kept_whole(plan: Plan, growths: GrowthsBeside | None) -> bool:
    """Whether a search keeps a plan that fits whole (fits_at's `plans`) rather than as its recipe alone: always with
    its growths made in turn; with growths beside, only a plan without a recipe (its weights stream, so it is never
    grown beside either, and its rate is its own). The others are made again from their recipes, and every fork beside
    a process holding more costs it more (BERT-base fp16 --batch auto: 30.1-31.9 s, 33.7-37.7 keeping them)."""
    return growths is None or recipe_of(plan.state) is None


def growable(chip) -> Callable[..., bool]:
    """Whether a probe's plan that fits (its lowering state and memory plan) is grown a step (fits_at): not when
    within NEAR_FULL of a tile, where the step is a few bytes (SigLIP so400m fp8 b11 and BERT-base fp16 b149, 99.3
    and 99.0 % full, gained nothing from a whole growth; BERT's took 14.7 s of lowerings)."""
    return lambda state, mp: plan_fullness(mp, chip) < NEAR_FULL


def find_max_batch(build: Callable[[int], Graph], chip, dtype: str = "fp32", limit: int = MAX_AUTO_BATCH,
                   progress: Progress | None = None, scales: dict[str, int] | None = None,
                   one_fits: bool | None = None, found: dict | None = None, partials: str = "float",
                   weights: str = "auto", grow: bool = False, growths: GrowthsBeside | None = None) -> int:
    """The largest batch whose plan fits (0 if batch 1 does not), by doubling then guesses; planner only. Fitting
    is not strictly monotone in the batch (splits and budgets change with it), so this is the largest the search
    finds, and every batch it returns has a plan that fits.

    Once plans without shared layers fail at some batch, larger batches try only shared-layer plans: the others
    grow with the batch (SigLIP so400m's reached 23 GB of host memory at batch 16) and did not fit at a smaller one.
    `found["shared_from"]` is then that batch, and `found["rates"]` the modelled samples/s of every batch planned
    that fits (batch 1's too when the caller passes them in), which compile_model's --batch auto chooses among; with
    `found["plans"]` (a dict the caller puts there) the AUTO_GROWN fastest of those plans are kept whole (fits_at).
    A caller whose batch 1 planned only with shared layers puts `found["shared_from"] = 1` there first. grow: each
    probe that fits is grown a step (fits_at) and its rate is the grown plan's (with `growths`, made beside: collected
    before this returns). A compile grows its plan further
    (pipeline.GROW_STEPS, then the costliest ops' budgets), most where the plan at the free budget left the most
    room, so that plan ranks batches otherwise than the compiles would: on a C600, SigLIP so400m fp8 batches 4, 8, 10
    and 11 at 252.3, 251.0, 264.5 and 272.7 samples/s, grown a step 273.2, 275.6, 264.5 and 272.7, compiled 281.2,
    302.7, 284.2 and 272.7; BERT-base fp16 batches 64, 128 and 149 at 5,516, 5,460 and 5,592, a step 5,690, 5,755 and
    5,592, compiled 6,058, 5,900 and 5,592. A step costs a lowering where the whole growth costs up to nine. Which
    batch fits is decided on the plans before growth.

    FP8 scales change no choice of a plan, so the search plans with `scales` or placeholder_scales; a shared
    layer's patched fields (vertex state, call cycles) move with them (1,212 of 56.8 M cycles for SigLIP so400m fp8
    at batch 8 between two sets of weights), and the placeholders patch the most. `one_fits`:
    the caller already planned batch 1. The search goes no higher than the lower bound allows (limits.py), so an
    impossible batch is never planned."""
    dt = resolve_dtype(dtype)
    if dt == "fp8" and scales is None:
        scales = placeholder_scales(build(1))
    limit = min(limit, bound_limit(build, chip, dt, weights=weights))
    if limit < 1:
        return 0
    probes = 0
    rates = found.setdefault("rates", {}) if found is not None else None
    plans = found.get("plans") if found is not None else None

    # smallest batch at which plans without shared layers failed (the caller's batch 1 may have)
    shared_from = found.get("shared_from", limit + 1) if found is not None else limit + 1

    full: dict[int, float] = {}  # batch -> how full its plan is (fits_at), for the guesses below
    # A batch above the largest that fitted so far starts at the budget that fitted it (pipeline.plan_graph's
    # budgets, fastest first): the faster ones did not fit a smaller batch (BERT-base fp16 at batch 141, after 140
    # fitted only at 0.12: its two 0.23 plans skipped, 7.6 -> 3.9 s). Like shared_from, a bet that plans grow with
    # the batch. Its shared layers' storage starts levelled when that one's was (plan/layers.spread_caps): BERT-base
    # fp16 from 128 on fitted only levelled, and each larger probe lowered its first budget unlevelled in vain first
    # (a second of a 4 s probe).
    start_batch = start_budget = start_level = 0

    def ok(b: int) -> bool:
        nonlocal probes, shared_from, start_batch, start_budget, start_level
        probes += 1
        if progress:
            progress("batch search", probes, probes + 1)
        at: list[int] = []
        fits, shared, f = fits_at(build, chip, dt, b, scales, shared_only=b >= shared_from, partials=partials,
                                  rates=rates, plans=plans, weights=weights,
                                  from_budget=start_budget if b > start_batch else 0, budget=at, grow=grow,
                                  level_from=bool(start_level) if b > start_batch else False, growths=growths)
        if shared:
            shared_from = min(shared_from, b)
        if f is not None:
            full[b] = f
        if fits and at and b > start_batch:
            start_batch, start_budget, start_level = b, at[0], at[1] if len(at) > 1 else 0
        return fits

    if not (one_fits if one_fits is not None else ok(1)):
        return 0
    lo, hi = 1, 2
    while hi <= limit and ok(hi):
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    # Between the last batch that fit and the first that did not, guess from how full their plans are (_guess). A
    # good guess fits and the batch after it does not, so a guess that fits within NEAR_FULL of a tile is followed by
    # the batch after it (near the answer the plans' fullness jumps: BERT-base fp16 once fitted at 140 with 96 % of a
    # tile and not at 141 with 101 %, where the line kept guessing 143, then 142); a guess that fits further from full
    # is followed by a new guess from it. When the batch after a guess fits too, the line through the batch
    # that failed undershoots: the next guess halves that batch's excess over a full tile (the Illinois method's
    # step), which leans it towards the failure, once more each time the failure is kept. SigLIP so400m fp8: 10 and
    # 11 fit under 16's line (99.3 % full at 11), and the halved line guesses 12, which fails, where bisection probed 13
    # first (12 s a failing probe). Two guesses that fail in a row mean the plans grow otherwise than in a line there:
    # a bisection step follows, so the search takes at most about twice bisection's probes.
    mode, last, halve = "guess", None, 0
    while hi - lo > 1:
        mid = {"guess": _guess(lo, hi, full, halve), "next": lo + 1, "bisect": (lo + hi) // 2}[mode]
        fits = ok(mid)
        lo, hi = (mid, hi) if fits else (lo, mid)
        halve = halve + 1 if fits and mode == "next" else (halve if fits else 0)
        if mode == "guess":
            near = full.get(mid, 1.0) >= NEAR_FULL
            mode = ("next" if near else "guess") if fits else ("bisect" if last is False else "guess")
        else:
            mode = "guess"
        last = fits
    if growths is not None:
        growths.collect()
    if found is not None and shared_from <= lo:
        found["shared_from"] = shared_from
    return lo


def _guess(lo: int, hi: int, full: dict[int, float], halve: int = 0) -> int:
    """The batch in (lo, hi) the line through the plans of lo (fits) and hi (does not) says is the last to fit:
    plans grow about linearly with the batch between doublings (activations and buffers per sample), so this lands
    on or next to the answer where bisection takes log2(hi - lo) probes (SigLIP so400m fp8 between 8 and 16, BERT-base
    fp16 between 128 and 256). `halve`: hi's excess over a full tile is halved that many times first (the caller's
    Illinois step). Bisection's midpoint when either plan's fullness is unknown (hi refused by the bound)."""
    a, b = full.get(lo), full.get(hi)
    if a is None or b is None or b <= a:
        return (lo + hi) // 2
    b = max(1.0 + (b - 1.0) / 2 ** halve, a + 1e-9) if b > 1.0 else b
    x = lo + (1.0 - a) * (hi - lo) / (b - a)
    return min(max(int(x), lo + 1), hi - 1)
