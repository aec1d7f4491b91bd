"""``kvfsm check``: run the model checker from the command line, with a progress display.

The progress display (shared with ``kvfsm bench``) uses ``rich`` if it is installed, else ``tqdm``, else plain
lines on stderr; none of them is needed (``pip install kvfsm[progress]`` brings rich). ``--quiet`` turns it off,
``--json`` prints the result as JSON on stdout. The exit status is 0 when nothing is violated, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TextIO

from kvfsm.check.bfs import MEMO_LIMIT, ExplorationResult, Violation, explore, format_trace, mermaid_sequence
from kvfsm.check.model import Bounds, Model, compiled
from kvfsm.check.promela import PromelaBounds
from kvfsm.check.properties import DrainMode
from kvfsm.cli import int_in
from kvfsm.errors import ConfigError
from kvfsm.observe.progress import Progress as ProgressDisplay
from kvfsm.validation import is_int

__all__ = [
    "EXPLORE_OPTIONS",
    "MAX_BOUNDS",
    "MAX_STATES",
    "TIER_PENDING",
    "add_arguments",
    "add_spin_arguments",
    "bounds_from",
    "explore_options_given",
    "promela_bounds_from",
    "replay_counterexample",
    "run",
    "run_spin_check",
]

#: (states, edges, queued, seconds) -> None
Progress = Callable[[int, int, int, float], None]


#: The largest value ``kvfsm check`` accepts for each bound (the state space grows exponentially: the
#: defaults, all 2 or 1, already give ~90k states). ``workers`` is the model's own limit.
MAX_BOUNDS: dict[str, int] = {
    "requests": 16,
    "prompts": 16,
    "chunks": 16,
    "workers": 8,
    "slots": 16,
    "groups": 16,
    "resets": 16,
    "preemptions": 16,
    "max_jobs": 10_000,
    "tiers": 2,
    "deadlines": 16,
    "sync_load_budget": 16,
}
#: ``--tier-pending``: what the last secondary tier's own has_pending_work() answers (spec/README.md, "A tier
#: whose pending work never ends: vLLM's KVCR tier"); "always" is the hazard of vLLM's KVCRSecondaryTierManager.
TIER_PENDING: tuple[str, ...] = ("honest", "always")
#: The largest ``--max-states`` (about what fits in memory).
MAX_STATES = 10**9
#: Options that only make sense when exploring (refused together with ``kvfsm check --trace``).
EXPLORE_OPTIONS: tuple[str, ...] = (
    "requests",
    "prompts",
    "chunks",
    "workers",
    "slots",
    "groups",
    "tiers",
    "resets",
    "preemptions",
    "max_jobs",
    "deadlines",
    "sync_load_budget",
    "late_writes",
    "reset_hold",
    "promotion_deadlines",
    "no_failures",
    "durable",
    "promotions",
    "tier_pending",
    "shutdown",
    "keep_going",
    "no_liveness",
    "max_states",
    "memo_limit",
    "replay",
    "brief",
    "drain",
    "diagram",
    "engine",
    "bitstate",
    "jobs",
    "cascades",
    "cores",
)
#: The native checker's options that the generated Promela composition does not model (kvfsm check --engine
#: spin refuses them; spec/README.md, "SPIN export").
NOT_FOR_SPIN: tuple[str, ...] = (
    "prompts",
    "chunks",
    "max_jobs",
    "sync_load_budget",
    "late_writes",
    "reset_hold",
    "promotion_deadlines",
    "durable",
    "keep_going",
    "max_states",
    "memo_limit",
    "replay",
    "diagram",
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The bounds and run options. Bounds left out are None here and take Bounds' defaults (bounds_from),
    so a caller can tell which were given."""
    d = Bounds()

    def bound(flag: str, lo: int, text: str, **kw: Any) -> None:
        name = flag[2:].replace("-", "_")
        hi = MAX_BOUNDS.get(name, 1)
        b.add_argument(
            flag,
            type=int_in(lo, hi),
            default=None,
            metavar="N",
            help=f"{text} ({getattr(d, name)}; {lo} to {hi})",
            **kw,
        )

    b = p.add_argument_group("bounds")
    bound("--requests", 1, "requests that arrive, in all")
    bound("--prompts", 1, "distinct prompts, sharing chunk 0")
    bound("--chunks", 1, "chunks per prompt")
    bound("--workers", 1, "W: workers copying each job")
    bound("--slots", 1, "CPU primary slots")
    bound("--groups", 1, "GPU block groups, one request each")
    bound("--tiers", 0, "secondary tiers")
    bound("--resets", 0, "reset_cache calls")
    bound("--preemptions", 0, "preemptions")
    bound("--max-jobs", 0, "jobs created in all; 0: no bound")
    bound("--deadlines", 0, "store deadlines that may pass (time_out, quarantine)")
    bound(
        "--sync-load-budget",
        0,
        "chunks per step a lookup hit may load synchronously, the step waiting for them before its forward "
        "(vLLM 0.34's sync_load_budget_bytes); 0: off",
    )
    b.add_argument("--no-failures", action="store_true", help="copies and cascades never fail")
    b.add_argument(
        "--durable",
        action="store_true",
        help="the last tier syncs each cascade in the background (its own pending work)",
    )
    b.add_argument(
        "--shutdown", action="store_true", help="the engine may be shut down (bounded): flush_all, give up, stop"
    )
    b.add_argument(
        "--promotions", action="store_true", help="the tiers hit what they hold: lookups promote it into the primary"
    )
    b.add_argument(
        "--late-writes",
        action="store_true",
        help="with --promotions: a copy that reset_cache discarded may still write the primary slot the reset "
        "freed until a step flushes it; a promotion submitted before then breaks stale_ids_ignored",
    )
    b.add_argument(
        "--reset-hold",
        action="store_true",
        help="with --promotions: after a reset, hold promotions (a key missing from the primary is a MISS) until "
        "every launched copy the reset discarded has reported (kvfsm's TieringManager, vLLM 0.34's _promotions_held)",
    )
    b.add_argument(
        "--promotion-deadlines",
        action="store_true",
        help="with --promotions and --deadlines N: promotion deadlines pass too (of the N); a timed-out promotion "
        "fails at once and its slot is held until its tier I/O is over (deferred release, pending work)",
    )
    b.add_argument(
        "--tier-pending",
        choices=list(TIER_PENDING),
        default=None,
        help="what the last tier's own has_pending_work() answers: honest (the default: True only while it has "
        "work) or always (True at every call, vLLM's KVCR tier: a hazard that liveness rejects)",
    )
    o = p.add_argument_group("run")
    o.add_argument(
        "--drain",
        choices=[m.value for m in DrainMode],
        default=None,
        help="the engine's drain mode (spec/invariants.toml [[drain_mode]]): non_blocking (the default, #45595) "
        "or blocking (the #42611 baseline, which responsiveness rejects)",
    )
    o.add_argument(
        "--diagram", action="store_true", help="also print each counterexample as a Mermaid sequence diagram"
    )
    o.add_argument("--keep-going", action="store_true", help="report the first violation of every invariant")
    o.add_argument("--no-liveness", action="store_true", help="skip the liveness check (and keep no edges)")
    o.add_argument(
        "--max-states",
        type=int_in(0, MAX_STATES),
        default=None,
        metavar="N",
        help=f"stop after this many states (0: no limit, the default; at most {MAX_STATES:,})",
    )
    o.add_argument(
        "--memo-limit",
        type=int_in(0, MAX_STATES),
        default=None,
        metavar="N",
        help=f"drop the model's memos whenever they hold more than N results: less memory, the same graph "
        f"({MEMO_LIMIT:,}, about 1.5 GB)",
    )
    o.add_argument(
        "--replay",
        action="store_true",
        help="also replay every edge on the implementation and probe it; with a violation, replay its counterexample",
    )
    o.add_argument("--quiet", action="store_true", help="no progress display")
    add_spin_arguments(p)
    o.add_argument("--json", action="store_true", help="print the result as JSON")
    o.add_argument("--brief", action="store_true", help="counterexamples without the state after each event")


def add_spin_arguments(p: argparse.ArgumentParser) -> None:
    """``--engine spin`` and the bounds only the generated Promela model has (kvfsm.check.promela)."""
    from kvfsm.check.promela import MAX_PROMELA_BOUNDS, PromelaBounds

    d = PromelaBounds()
    s = p.add_argument_group("spin (--engine spin: SPIN on the Promela model generated from spec/)")
    s.add_argument(
        "--engine",
        choices=["bfs", "spin"],
        default=None,
        help="bfs: kvfsm's own checker (the default); spin: generate Promela from spec/ and run SPIN on it "
        "(uses --requests, --workers, --slots, --groups, --resets, --preemptions, --deadlines, --shutdown, "
        "--tiers, --promotions, --tier-pending, --drain, --no-failures, --no-liveness)",
    )
    s.add_argument("--bitstate", action="store_true", help="with --engine spin: bitstate hashing (-DBITSTATE)")
    s.add_argument(
        "--cores",
        type=int_in(1, 64),
        default=None,
        metavar="N",
        help="with --engine spin: pan's multi-core safety search on N cores (-DNCORE=N; 1, the default: one core)",
    )
    for name, text in (("jobs", "store jobs in all"), ("cascades", "write-through cascades in all")):
        lo = 0 if name == "cascades" else 1
        hi = MAX_PROMELA_BOUNDS[name]
        s.add_argument(
            f"--{name}",
            type=int_in(lo, hi),
            default=None,
            metavar="N",
            help=f"with --engine spin: {text} ({getattr(d, name)}; {lo} to {hi})",
        )


def promela_bounds_from(args: argparse.Namespace, *, liveness: bool = False) -> PromelaBounds:
    """The generated model's bounds from ``kvfsm check --engine spin`` or ``kvfsm export promela`` options."""
    from kvfsm.check.promela import MAX_PROMELA_BOUNDS, PromelaBounds

    d = PromelaBounds()

    def get(option: str, name: str) -> int:
        value = getattr(args, option, None)
        value = getattr(d, name) if value is None else value
        hi = MAX_PROMELA_BOUNDS[name]
        if value > hi:
            raise ConfigError(
                f"--{option.replace('_', '-')} {value} is too large for the Promela model; expected at most {hi}"
            )
        result: int = value
        return result

    return PromelaBounds(
        jobs=get("jobs", "jobs"),
        ranks=get("workers", "ranks"),
        slots=get("slots", "slots"),
        requests=get("requests", "requests"),
        cascades=get("cascades", "cascades"),
        groups=get("groups", "groups"),
        resets=get("resets", "resets"),
        preemptions=get("preemptions", "preemptions"),
        deadlines=get("deadlines", "deadlines"),
        shutdown=bool(getattr(args, "shutdown", False)),
        tiers=get("tiers", "tiers"),
        promotions=bool(getattr(args, "promotions", False)),
        failures=not getattr(args, "no_failures", False),
        drain=DrainMode(args.drain) if getattr(args, "drain", None) else DrainMode.NON_BLOCKING,
        tier_pending_always=_tier_pending_always(args),
        liveness=liveness,
    )


def run_spin_check(args: argparse.Namespace) -> int:
    """``kvfsm check --engine spin``: the safety run, then (unless --no-liveness) the liveness run."""
    from kvfsm.check.spin import format_trace, run_spin

    refused = [
        "--" + name.replace("_", "-")
        for name in NOT_FOR_SPIN
        if getattr(args, name, None) is not None and getattr(args, name, None) is not False
    ]
    if refused:
        allowed = ", ".join(
            "--" + name.replace("_", "-") for name in EXPLORE_OPTIONS if name not in (*NOT_FOR_SPIN, "engine")
        )
        raise ConfigError(
            f"{', '.join(refused)} are not in the generated Promela model; expected only {allowed} with --engine spin"
        )
    cores = getattr(args, "cores", None) or 1
    if cores > 1 and not args.no_liveness:
        raise ConfigError("--cores runs pan's multi-core safety search only; add --no-liveness")
    runs = [False] if args.no_liveness else [False, True]
    results = []
    for liveness in runs:
        bounds = promela_bounds_from(args, liveness=liveness)
        results.append(run_spin(bounds, bitstate=bool(args.bitstate), cores=cores))
    if args.json:
        json.dump([r.summary() for r in results], sys.stdout, indent=2)
        print()
    else:
        for r in results:
            what = "liveness (LTL, weak fairness)" if r.liveness else "safety assertions"
            print(
                f"spin {what}{', bitstate' if r.bitstate else ''}{f', {r.cores} cores' if r.cores > 1 else ''}: "
                f"{_promela_bounds_text(r.bounds.as_dict())}: "
                f"errors: {r.errors}, {r.states:,} states stored, {r.transitions:,} transitions in {r.seconds:.2f} s "
                f"({r.states_per_second:,.0f} states/s), depth {r.depth:,}"
                + ("" if r.complete else ", search incomplete")
                + (f"; violated: {', '.join(r.violated)}" if r.violated else "")
            )
            if r.trace:
                print()
                print(format_trace(r, states=not args.brief))
                print()
    return 0 if all(r.ok for r in results) else 1


def _promela_bounds_text(d: dict[str, object]) -> str:
    return ", ".join(f"{k}={v}" for k, v in d.items())


def explore_options_given(args: argparse.Namespace) -> list[str]:
    """The exploration options set on the command line (``--requests``, ``--replay``, ...)."""
    given = []
    for name in EXPLORE_OPTIONS:
        value = getattr(args, name, None)
        if value is not None and value is not False:
            given.append("--" + name.replace("_", "-"))
    return given


def bounds_from(args: argparse.Namespace) -> Bounds:
    """Bounds from parsed options; ConfigError if one is out of range (also when not parsed by argparse)."""
    d = Bounds()

    def get(name: str) -> int:
        value = getattr(args, name, None)
        value = getattr(d, name) if value is None else value
        hi = MAX_BOUNDS.get(name)
        if hi is not None and is_int(value) and value > hi:
            raise ConfigError(f"bound {name} = {value} is too large to explore; expected at most {hi}")
        result: int = value
        return result

    return Bounds(
        requests=get("requests"),
        prompts=get("prompts"),
        chunks=get("chunks"),
        workers=get("workers"),
        slots=get("slots"),
        groups=get("groups"),
        tiers=get("tiers"),
        resets=get("resets"),
        preemptions=get("preemptions"),
        failures=not args.no_failures,
        durable=bool(getattr(args, "durable", False)),
        promotions=bool(getattr(args, "promotions", False)),
        shutdown=bool(getattr(args, "shutdown", False)),
        max_jobs=get("max_jobs"),
        deadlines=get("deadlines"),
        tier_pending_always=_tier_pending_always(args),
        sync_load_budget=get("sync_load_budget"),
        late_writes=bool(getattr(args, "late_writes", False)),
        reset_hold=bool(getattr(args, "reset_hold", False)),
        promotion_deadlines=bool(getattr(args, "promotion_deadlines", False)),
    )


def _tier_pending_always(args: argparse.Namespace) -> bool:
    """``--tier-pending always``; ConfigError for a value that is not one of TIER_PENDING."""
    value = getattr(args, "tier_pending", None)
    if value is None:
        return False
    if value not in TIER_PENDING:
        raise ConfigError(f"tier_pending must be one of {list(TIER_PENDING)}, got {value!r}")
    return bool(value == "always")


@contextmanager
def progress_display(enabled: bool, stream: TextIO = sys.stderr) -> Iterator[Progress | None]:
    """A progress callback for explore(), on the shared progress display (:mod:`kvfsm.observe.progress`)."""
    if not enabled:
        yield None
        return
    with ProgressDisplay(None, "exploring", stream=stream) as display:

        def update(states: int, edges: int, queued: int, seconds: float) -> None:
            rate = states / seconds if seconds > 0 else 0.0
            display.status(
                f"{states:,} states, {edges:,} edges, {queued:,} queued, {seconds:.1f} s ({rate:,.0f} states/s)",
                final=queued == 0,
            )

        yield update


def run(args: argparse.Namespace) -> int:
    if getattr(args, "engine", None) == "spin":
        return run_spin_check(args)
    if (
        getattr(args, "bitstate", False)
        or getattr(args, "jobs", None) is not None
        or getattr(args, "cascades", None) is not None
        or getattr(args, "cores", None) is not None
    ):
        raise ConfigError(
            "--bitstate, --cores, --jobs and --cascades apply to the generated Promela model; add --engine spin"
        )
    bounds = bounds_from(args)
    max_states = 0 if args.max_states is None else args.max_states
    if not is_int(max_states) or not 0 <= max_states <= MAX_STATES:
        raise ConfigError(f"max_states must be an integer from 0 to {MAX_STATES}, got {max_states!r}")
    show = not args.quiet and not args.json
    drain = DrainMode(args.drain) if getattr(args, "drain", None) else DrainMode.NON_BLOCKING
    if args.replay and drain is not DrainMode.NON_BLOCKING:
        raise ConfigError("--replay replays the implementation, whose drain is non_blocking; drop --drain blocking")
    if args.replay and bounds.tier_pending_always:
        raise ConfigError(
            "--replay replays the implementation, whose tiers report only real pending work; drop --tier-pending always"
        )
    if args.replay and bounds.sync_load_budget:
        raise ConfigError(
            "--replay replays the implementation, which loads asynchronously only; drop --sync-load-budget"
        )
    if args.replay and bounds.promotion_deadlines:
        raise ConfigError(
            "--replay replays the implementation, whose harness passes store deadlines only; drop --promotion-deadlines"
        )
    if args.replay and bounds.promotions and bounds.resets and not bounds.reset_hold:
        # The implementation holds promotions until the copies a reset discarded have reported; the model without
        # the hold promotes there (spec/README.md, "The reset hold").
        raise ConfigError(
            "--replay replays the implementation, which holds promotions after a reset until the copies it "
            "discarded have reported; add --reset-hold, or --resets 0"
        )
    model = Model(bounds, drain)
    if show:
        print(f"kvfsm check: {_bounds_text(bounds)}, drain={drain.value}", file=sys.stderr)
    with progress_display(show) as progress:
        result = explore(
            bounds,
            stop_at_first=not args.keep_going,
            keep_graph=not args.no_liveness or args.replay,
            check_liveness=not args.no_liveness,
            max_states=max_states,
            memo_limit=MEMO_LIMIT if args.memo_limit is None else args.memo_limit,
            progress=progress,
            model=model,
        )
    summary: dict[str, Any] = result.summary()
    replay: dict[str, Any] | None = None
    if args.replay and result.graph is not None and result.ok:
        from kvfsm.check.replay import replay_edges

        rep = replay_edges(result)
        replay = {
            "edges_replayed": rep.edges_replayed,
            "probes": rep.probes,
            "seconds": round(rep.seconds, 3),
            "mismatches": [str(m) for m in rep.mismatches],
            "probe_failures": rep.probe_failures[:20],
        }
        summary["replay"] = replay
    followed: list[str] = []
    if args.replay and result.violations:
        followed = [replay_counterexample(v, model) for v in result.violations]
        summary["counterexample_replays"] = followed
    if args.json:
        json.dump(summary, sys.stdout, indent=2)
        print()
    else:
        _print_text(result, model, replay, brief=args.brief, diagram=bool(getattr(args, "diagram", False)))
        for line in followed:
            print(line)
    failed = bool(result.violations) or bool(replay and (replay["mismatches"] or replay["probe_failures"]))
    return 1 if failed else 0


def replay_counterexample(v: Violation, model: Model) -> str:
    """Drive the implementation along a counterexample (``kvfsm check --replay`` when a violation is found)
    and say, in one line, whether the real code follows it event for event."""
    from kvfsm.check.replay import abstract, replay_path
    from kvfsm.errors import KvfsmError

    try:
        h = replay_path(model.bounds, model, v.path, v.states)
    except (AssertionError, KvfsmError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return f"the implementation does NOT follow the {v.invariant} counterexample: {first}"
    if v.label is None:
        return f"the implementation follows all {v.length} events of the {v.invariant} counterexample"
    _, refs = abstract(h, model)
    try:
        h.apply(v.label, refs)
    except KvfsmError as exc:
        return (
            f"the implementation follows the {v.invariant} counterexample for {len(v.path)} events and refuses "
            f"the violating one: {type(exc).__name__}: {exc}"
        )
    return (
        f"the implementation follows all {v.length} events of the {v.invariant} counterexample, the violating one too"
    )


def _bounds_text(b: Bounds) -> str:
    return ", ".join(f"{k}={v}" for k, v in b.as_dict().items())


def _print_text(
    result: ExplorationResult, model: Model, replay: dict[str, Any] | None, *, brief: bool, diagram: bool = False
) -> None:
    status = "complete" if result.complete else "stopped early"
    print(
        f"{result.states:,} states, {result.edges:,} edges in {result.seconds:.2f} s "
        f"({result.states_per_second:,.0f} states/s, {result.edges / max(result.seconds, 1e-9):,.0f} edges/s; "
        f"{result.cpu_seconds:.2f} s CPU, {result.states_per_cpu_second:,.0f} states/s by CPU time, "
        f"{'compiled' if compiled() else 'interpreted'}); "
        f"{status}"
        + (f", {result.pruned:,} edges pruned by --max-jobs" if result.pruned else "")
        + (", liveness checked" if result.liveness_checked else "")
        + (f", memos dropped {result.memos_trimmed:,} times at --memo-limit" if result.memos_trimmed else "")
        + f"; drain={result.drain.value}, responsiveness checked on {result.responsiveness_checks:,} arrivals "
        "while draining"
        + (
            f"; sync loads of at most {result.bounds.sync_load_budget} chunk(s) per step: a blocked step waits for "
            f"at most {result.max_step_wait_chunks} chunk(s), {result.step_wait_arrivals:,} arrivals while it waits"
            if result.bounds.sync_load_budget
            else ""
        )
    )
    for v in result.violations:
        print()
        print(format_trace(v, model, states=not brief))
        if diagram:
            print()
            print(mermaid_sequence(v, model))
    if replay is not None:
        print(
            f"replayed {replay['edges_replayed']:,} edges and {replay['probes']:,} negative probes on the "
            f"implementation in {replay['seconds']:.1f} s: {len(replay['mismatches'])} mismatches, "
            f"{len(replay['probe_failures'])} probe failures"
        )
        for line in [*replay["mismatches"], *replay["probe_failures"]]:
            print(f"  {line}")
    if not result.violations:
        print("no invariant violated")


def main(argv: list[str] | None = None) -> int:
    """``python -m kvfsm.check.cli``: the same as ``kvfsm check`` without ``--trace``."""
    from kvfsm.cli import main as cli_main

    return cli_main(["check", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
