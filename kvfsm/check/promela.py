"""Generate a Promela model of the spec for SPIN (``kvfsm export promela``, ``kvfsm check --engine spin``).

Nothing here is a second, hand-written model. The generator reads the spec and the shared decisions at
generation time and writes them out:

- every machine's states (and the effects its rows carry) become ``mtype`` constants, and every row of the
  machine's *compiled table* (:attr:`kvfsm.machines.compiled.SpecMachine.table`, so a row planted with
  ``SpecMachine.planted(table_edits=...)`` is exported as planted) becomes a guarded branch of one ``inline``
  per ``(machine, event)``, tried in table order, first match fires (spec/README.md, Rule 3);
- every guard becomes an inline predicate over the composition variables the guard's model names
  (``launched_mask``, ``reported_mask``, ``failed_reports`` and the rank for a job; ``readers`` for a slot;
  ``has_jobs`` for a request; ``has_pending_push_work`` for the engine): a truth table obtained by calling the
  machine's *bound* guard function on every value of its finite domain. A planted guard is exported planted;
- the shared pure decisions are tabulated the same way: ``pending_push_work`` (the engine's settle guard input,
  over every combination of the jobs' awaited/pending counts and the other pending work: quarantine and the
  manager's transfers), ``is_evictable`` (the CPU tier's eviction choice), ``settle_event`` (the engine's
  end-of-step decision), ``fenced_jobs`` (which stores a step flushes, over the GPU groups handed out and
  every job's fence) and ``stale_threshold_after_reset`` (over every job counter and threshold).

The composition around them is generic and driven by the bounds: ``J`` store jobs copied by ``W`` ranks
(per-rank launch, copy, report, the spec's per-rank ack rule in the job guards), ``K`` slots, ``R`` requests
(arrival, lookup, load, store, finish, signal, delete), ``G`` GPU block groups with fences, preemptions,
``reset_cache``, store deadlines with quarantine, a bounded shutdown, a manager that cascades committed
slots to up to two tiers, promotes what a tier holds and evicts, and one engine whose steps flush, write the
held groups and fire ``settle_event``'s answer. Properties come from ``spec/invariants.toml`` where they are
expressible as assertions at every atomic step; spec/README.md, "SPIN export", lists what is covered and
what is abstracted away. Every step prints its event and the abstract state after it, for ``spin -t``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import kvfsm.control.cpu as cpu_mod
import kvfsm.control.scheduler as scheduler_mod
from kvfsm.check.properties import DrainMode, load_drain_modes
from kvfsm.control.decisions import settle_event
from kvfsm.errors import ConfigError
from kvfsm.machines import engine_machine, job_machine, request_machine, slot_machine
from kvfsm.machines.compiled import SpecMachine
from kvfsm.machines.names import EngineState, SlotState

__all__ = ["MAX_PROMELA_BOUNDS", "PROPERTIES", "PromelaBounds", "generate"]

#: The largest value each bound may take (the truth tables grow as (W+2)^J and 4^W).
MAX_PROMELA_BOUNDS: dict[str, int] = {
    "jobs": 6,
    "ranks": 4,
    "slots": 6,
    "requests": 6,
    "cascades": 6,
    "groups": 3,
    "resets": 3,
    "preemptions": 3,
    "deadlines": 3,
    "tiers": 2,
}
#: Bounds that may be 0 (the others are at least 1).
_MAY_BE_ZERO = frozenset({"cascades", "resets", "preemptions", "deadlines", "tiers"})

#: The properties the generated model asserts, each by the name of the spec entry it expresses
#: (``spec/invariants.toml``). Every assertion names its property through a never-set hidden flag, first in
#: the assertion, so that pan's "assertion violated" line (which pan cuts short) says which one failed.
PROPERTIES: tuple[str, ...] = (
    "pending_work_covers_jobs",
    "idle_only_when_nothing_pending",
    "readable_only_after_commit",
    "evict_only_ready_unreferenced",
    "gpu_source_not_overwritten",
    "stale_ids_ignored",
    "responsiveness",
    "liveness",
)


@dataclass(frozen=True, slots=True)
class PromelaBounds:
    """The generated composition's bounds: ``jobs`` store jobs x ``ranks`` workers, ``slots`` CPU slots,
    ``requests`` requests, at most ``cascades`` cascades in all, ``groups`` GPU block groups, at most
    ``resets`` reset_cache calls and ``preemptions`` preemptions, ``deadlines`` store deadlines that may pass,
    a bounded ``shutdown``, and the engine's drain mode."""

    jobs: int = 2
    ranks: int = 2
    slots: int = 2
    requests: int = 2
    cascades: int = 1
    groups: int = 1
    resets: int = 1
    preemptions: int = 1
    deadlines: int = 0  #: store deadlines that may pass, in all (time_out, quarantine)
    shutdown: bool = False  #: the engine may be shut down (bounded): flush_all, give up, stop
    tiers: int = 1  #: write-through secondary tiers (0 to 2): every commit cascades to each
    promotions: bool = False  #: the tiers hit what they hold: a lookup promotes it into the primary
    failures: bool = True
    drain: DrainMode = DrainMode.NON_BLOCKING
    #: the last tier's own has_pending_work() answers True at every call (vLLM's KVCR tier; liveness rejects it)
    tier_pending_always: bool = False
    liveness: bool = False  #: also emit the LTL liveness claim (run pan with -a -f, not -DSAFETY)

    def __post_init__(self) -> None:
        for name, hi in MAX_PROMELA_BOUNDS.items():
            value = getattr(self, name)
            lo = 0 if name in _MAY_BE_ZERO else 1
            if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
                raise ConfigError(f"promela bound {name} = {value!r}; expected an integer from {lo} to {hi}")
        if self.promotions and not self.tiers:
            raise ConfigError("promotions=True needs a secondary tier; expected tiers >= 1")
        if self.tier_pending_always and not self.tiers:
            raise ConfigError("tier_pending_always=True needs a secondary tier; expected tiers >= 1")

    def as_dict(self) -> dict[str, object]:
        return {
            "jobs": self.jobs,
            "ranks": self.ranks,
            "slots": self.slots,
            "requests": self.requests,
            "cascades": self.cascades,
            "groups": self.groups,
            "resets": self.resets,
            "preemptions": self.preemptions,
            "deadlines": self.deadlines,
            "shutdown": self.shutdown,
            "tiers": self.tiers,
            "promotions": self.promotions,
            "failures": self.failures,
            "drain": self.drain.value,
            "tier_pending_always": self.tier_pending_always,
        }


# ------------------------------------------------------------------------------------------- guard models


@dataclass(slots=True)
class _JobProbe:
    state: object
    world_size: int
    launched_mask: int
    reported_mask: int
    failed_reports: int


@dataclass(slots=True)
class _SlotProbe:
    state: object
    readers: int


@dataclass(slots=True)
class _RequestProbe:
    state: object
    jobs: bool

    def has_jobs(self) -> bool:
        return self.jobs


@dataclass(slots=True)
class _EngineProbe:
    state: object
    pending: bool

    def has_pending_push_work(self) -> bool:
        return self.pending


@dataclass(frozen=True, slots=True)
class _Awaited:
    pending: int
    world_size: int


# ------------------------------------------------------------------------------------------- helpers

_PREFIX = {"job": "J", "slot": "S", "request": "R", "engine": "E"}


def _st(machine: str, state: str) -> str:
    return f"{_PREFIX[machine]}_{state}"


def _eff(effect: str | None) -> str:
    return "X_none" if effect is None else f"X_{effect}"


def _constant(value: bool) -> Callable[[], bool]:
    return lambda: value


def _bits(values: Iterable[bool]) -> list[int]:
    return [i for i, v in enumerate(values) if v]


class _Writer:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, text: str = "") -> None:
        self.lines.extend(text.splitlines() or [""])

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


#: Table bits per ``int`` word (31: no sign bit).
_WORD = 31


def _table_array(w: _Writer, name: str, values: list[bool], hidden: str) -> list[str]:
    """Declare a bit table packed into ``int`` words (read it with ``TBIT(name, i)``); return the init
    statements that set its non-zero words. ``hidden`` is ``"hidden "`` or ``""`` (multi-core pan refuses
    hidden variables: the table is then part of every state, constant)."""
    words = [0] * max(1, (len(values) + _WORD - 1) // _WORD)
    for i in _bits(values):
        words[i // _WORD] |= 1 << (i % _WORD)
    w(f"{hidden}int {name}[{len(words)}];")
    return [f"{name}[{i}] = {v}" for i, v in enumerate(words) if v]


def _value_table(w: _Writer, name: str, values: list[int], hidden: str) -> tuple[list[str], str]:
    """A table of small non-negative integers as bit planes; return the init statements and a macro body
    that reads entry ``IDX`` (substitute the index expression for IDX)."""
    planes = max(1, max(values, default=0).bit_length())
    init: list[str] = []
    terms = []
    for p in range(planes):
        init += _table_array(w, f"{name}_{p}", [bool(v >> p & 1) for v in values], hidden)
        terms.append(f"(TBIT({name}_{p}, IDX) << {p})")
    return init, "(" + " + ".join(terms) + ")"


# ------------------------------------------------------------------------------------------- trace printing
#
# Every atomic step of the composition starts with ``printf("EV|...")`` (the event, in the spec's words) and
# ends with ``show_state()`` (``printf("ST|...")``, the abstract state after it). pan ignores printf while it
# searches; ``spin -t`` replays a counterexample's trail and prints them, and kvfsm.check.spin turns them
# into a numbered event trace.

#: The fields of a ``ST|`` line, per record kind, in the order ``show_state()`` prints them.
TRACE_FIELDS: dict[str, tuple[str, ...]] = {
    "engine": ("state", "blocked", "hold"),
    "request": ("state", "arrived", "queued", "live", "group"),
    "job": ("state", "created", "group", "id"),  # then one shard code per rank
    "slot": ("state", "readers", "written_by", "cascades", "promotion"),
    "group": ("busy", "owner"),
}


def _ev(text: str, *args: str) -> str:
    return 'printf("EV|' + text + '\\n"' + "".join(f", {a}" for a in args) + ")"


# ------------------------------------------------------------------------------------------- generator


def generate(bounds: PromelaBounds | None = None, *, hidden: bool = True) -> str:
    """The Promela model for ``bounds``, from the spec tables and the shared decisions as they are now
    (planted bugs included). ``hidden=False`` declares no hidden variable (for multi-core pan, -DNCORE:
    the tables and scratch variables are then stored in every state, constant)."""
    b = bounds or PromelaBounds()
    hid = "hidden " if hidden else ""
    jm, sm, rm, em = job_machine(), slot_machine(), request_machine(), engine_machine()
    machines: dict[str, SpecMachine[Any, Any, Any]] = {
        "job": jm,
        "slot": sm,
        "request": rm,
        "engine": em,
    }
    J, W, K, R, G = b.jobs, b.ranks, b.slots, b.requests, b.groups
    M = 1 << W
    ALL = M - 1
    T = max(1, b.tiers)  # cascade arrays are never empty; with tiers=0 no cascade starts
    max_readers = R + K * T  # every request loading one slot, every slot cascading once to every tier
    drain_effect = load_drain_modes()[b.drain].settle_effect
    w = _Writer()
    init: list[str] = []
    st = _st

    w(f"/* kvfsm: generated by kvfsm.check.promela from spec/*.toml; bounds {b.as_dict()} */")
    w("/* Do not edit: regenerate with `kvfsm export promela`. */")
    w(f"#define J {J}")
    w(f"#define W {W}")
    w(f"#define K {K}")
    w(f"#define R {R}")
    w(f"#define G {G}")
    w(f"#define ALLRANKS {ALL}")
    w(f"#define NCASC {b.cascades if b.tiers else 0}")
    w(f"#define T {T}")
    w(f"#define NRESETS {b.resets}")
    w(f"#define NPREEMPT {b.preemptions}")
    w(f"#define NDEADLINES {b.deadlines}")
    # ---------------------------------------------------------------- mtypes: states and effects
    names: list[str] = []
    for m, mach in machines.items():
        names += [st(m, s) for s in mach.spec.states]
    effects = sorted({e for mach in machines.values() for e in mach.spec.effects})
    names += ["X_none", *(_eff(e) for e in effects)]
    w(f"mtype = {{ {', '.join(names)} }};")
    w()
    # ---------------------------------------------------------------- composition variables
    w("/* job j: owned by request j % R, writes the slot of its owner's chunk, reads its owner's GPU group */")
    w("mtype jst[J];            /* job machine state */")
    w("bit jcreated[J];         /* planned by the scheduler */")
    w("byte jl[J];              /* launched_mask */")
    w("byte jr[J];              /* reported_mask */")
    w("byte jf[J];              /* failed_reports */")
    w("byte jgroup[J];          /* the GPU group its copy reads (its owner's, when it was planned) */")
    w("byte jid[J];             /* its job id (the scheduler's counter when it was planned) */")
    w("byte cp[J * W];          /* rank w's shard of job j: 0 none, 1 copying, 2 done ok, 3 done failed, 4 reported */")
    w("bit jexp[J];             /* its deadline has passed (the clock); the next step times it out */")
    w("bit jquar[J];            /* timed out with a launched copy unreported: its slot stays held (quarantine) */")
    w("byte nexp;               /* deadlines passed, in all */")
    w("bit abandoned;           /* a bounded shutdown gave up: what is left is no longer pending work */")
    w("byte njobs;              /* the scheduler's job counter: ids issued so far */")
    w("byte thr;                /* the stale threshold: reports of ids below it are ignored */")
    w("mtype sst[K];            /* slot machine state */")
    w("byte srd[K];             /* slot readers */")
    w("byte wmask[K];           /* ground truth: ranks whose shard of the slot's current write finished ok */")
    w("bit casc[T * K];         /* tier t's cascade (a manager transfer) reads slot k: casc[t * K + k] */")
    w("byte held[T];            /* ground truth: the slots whose data tier t holds (a cascade's I/O succeeded) */")
    w("byte prom[K];            /* a promotion into slot k: 0 none, 1 queued for the step, 2 its tier's I/O runs */")
    w("byte promt[K];           /* the tier it promotes from */")
    w("byte ncasc;              /* cascades started, in all */")
    w("mtype rst[R];            /* request machine state */")
    w("bit arrived[R];          /* arrived in the engine's input queue */")
    w("bit queued[R];           /* arrived, not admitted yet */")
    w("bit live[R];             /* admitted: the request machine runs */")
    w("bit awaiting[R];         /* arrived while finishing/draining, not looked up yet */")
    w("byte rgroup[R];          /* the GPU group the engine gave it (while gbusy[rgroup[r]] and gowner is r) */")
    w("bit gbusy[G];            /* the group is held by a running or loading request */")
    w("byte gowner[G];          /* the request that holds it (or held it last) */")
    w("byte galloc;             /* groups handed out since the last step (the open batch) */")
    w("bit rflush;              /* a reset discarded jobs: the next step flushes their copies */")
    w("byte nresets;")
    w("byte npreempt;")
    w("bit hold;                /* responsiveness: after such an arrival, no worker launches, no copy or cascade")
    w("                            completes (outside the engine's own step) until it is looked up */")
    w("bit blocked;             /* blocking drain: the step waits inside flush_all */")
    w("mtype est;               /* engine machine state */")
    w("/* scratch, reset at the end of every atomic step (check_invariants) */")
    w(f"{hid}byte fired;")
    w(f"{hid}mtype eff;")
    w(f"{hid}byte flushed;")
    for p in PROPERTIES:
        w(f"{hid}byte violated_{p};  /* never set: names the property in pan's assertion message */")
    w()
    # ---------------------------------------------------------------- guards as truth tables
    w(f"#define TBIT(t, i) ((t[(i) / {_WORD}] >> ((i) % {_WORD})) & 1)")
    w("/* guards: truth tables of the bound guard functions over their model's variables */")
    guard_macro: dict[tuple[str, str], str] = {}
    for gname, fn in jm.guards.items():
        values = []
        for lm, rmask, nf, rank in itertools.product(range(M), range(M), range(W + 1), range(W)):
            values.append(bool(fn(_JobProbe(None, W, lm, rmask, nf), rank)))
        init += _table_array(w, f"G_job_{gname}", values, hid)
        w(f"#define g_job_{gname}(j, r) TBIT(G_job_{gname}, ((jl[j] * {M} + jr[j]) * {W + 1} + jf[j]) * {W} + (r))")
        guard_macro["job", gname] = f"g_job_{gname}"
    for gname, fn in sm.guards.items():
        values = [bool(fn(_SlotProbe(None, n), 0)) for n in range(max_readers + 1)]
        init += _table_array(w, f"G_slot_{gname}", values, hid)
        w(f"#define g_slot_{gname}(k, r) TBIT(G_slot_{gname}, srd[k])")
        guard_macro["slot", gname] = f"g_slot_{gname}"
    for gname, fn in rm.guards.items():
        values = [bool(fn(_RequestProbe(None, hj), 0)) for hj in (False, True)]
        init += _table_array(w, f"G_request_{gname}", values, hid)
        w(f"#define g_request_{gname}(i, r) TBIT(G_request_{gname}, HAS_JOBS(i))")
        guard_macro["request", gname] = f"g_request_{gname}"
    for gname, fn in em.guards.items():
        values = [bool(fn(_EngineProbe(None, p), 0)) for p in (False, True)]
        init += _table_array(w, f"G_engine_{gname}", values, hid)
        w(f"#define g_engine_{gname}(i, r) TBIT(G_engine_{gname}, PPW)")
        guard_macro["engine", gname] = f"g_engine_{gname}"
    w()
    # ---------------------------------------------------------------- shared decisions, tabulated
    w("/* pending_push_work(awaited jobs, manager_has_pending_work): tabulated over each job's code")
    w("   (0: not awaited, 1 + pending count) and the manager's pending work */")
    codes = W + 2
    ppw_values = []
    for combo in itertools.product(range(codes), repeat=J):
        for mgr in (False, True):
            awaited = [_Awaited(c - 1, W) for c in combo if c > 0]
            ppw_values.append(bool(scheduler_mod.pending_push_work(awaited, _constant(mgr))))
    init += _table_array(w, "PPWTAB", ppw_values, hid)
    popcount = " + ".join(f"((jr[j] >> {i}) & 1)" for i in range(W))
    w("#define AWAITED(j) (jcreated[j] && (jst[j] == J_submitted || jst[j] == J_in_flight))")
    w(f"#define JCODE(j) (AWAITED(j) -> (1 + W - ({popcount})) : 0)")
    # the manager's transfers: cascades and submitted promotions (a queued one is a reservation)
    w(
        "#define MGR_PENDING ("
        + " || ".join([f"casc[{i}]" for i in range(T * K)] + [f"prom[{k}] == 2" for k in range(K)])
        + ")"
    )
    unreported = {
        j: " || ".join(f"(cp[{j} * W + {r}] >= 1 && cp[{j} * W + {r}] <= 3)" for r in range(W)) for j in range(J)
    }
    for j in range(J):
        w(f"#define UNREPORTED_{j} ({unreported[j]})")
    w("#define UNREPORTED(j) (" + " || ".join(f"(j == {j} && UNREPORTED_{j})" for j in range(J)) + ")")
    w("/* the scheduler's quarantine term: a timed-out job whose launched copies have not all reported */")
    w("#define QUARANTINE (" + " || ".join(f"(jquar[{j}] && UNREPORTED_{j})" for j in range(J)) + ")")
    w("/* the last tier's own has_pending_work(), beyond its cascades: 1 when it answers True at every call")
    w("   (tier_pending_always: vLLM's KVCR tier), else 0 */")
    w(f"#define TIER_PENDING_ALWAYS {int(b.tier_pending_always)}")
    w("/* the other pending work pending_push_work is asked about: the quarantine and the manager's cascades")
    w("   and tiers, all given up on once a bounded shutdown abandoned them */")
    w("#define OTHER_PENDING (!abandoned && (QUARANTINE || MGR_PENDING || TIER_PENDING_ALWAYS))")
    # index: the job codes in mixed radix, job 0 most significant, then the manager bit
    idx = "0"
    for j in range(J):
        idx = f"({idx}) * {codes} + JCODE({j})"
    w(f"#define PPW TBIT(PPWTAB, ({idx}) * 2 + OTHER_PENDING)")
    evictable = [bool(cpu_mod.is_evictable(SlotState(s))) for s in sm.spec.states]
    w("/* is_evictable(slot state), by the order of the slot states */")
    for s, can_evict in zip(sm.spec.states, evictable, strict=True):
        w(f"#define EVICTABLE_{s} {int(can_evict)}")
    w(
        "#define EVICTABLE(k) ("
        + " || ".join(f"(sst[k] == {st('slot', s)} && EVICTABLE_{s})" for s in sm.spec.states)
        + ")"
    )
    owned = {r: [j for j in range(J) if j % R == r] for r in range(R)}
    for r in range(R):
        terms = " || ".join(f"AWAITED({j})" for j in owned[r]) or "0"
        w(f"#define HAS_JOBS_{r} ({terms})")
    w("#define HAS_JOBS(i) (" + " || ".join(f"(i == {r} && HAS_JOBS_{r})" for r in range(R)) + ")")
    unfinished_states = ("tracked", "deferred", "loading", "running", "preempted")
    w(
        "#define HAS_UNFINISHED ("
        + " || ".join(
            f"queued[{r}] || (live[{r}] && ("
            + " || ".join(f"rst[{r}] == {st('request', s)}" for s in unfinished_states)
            + "))"
            for r in range(R)
        )
        + ")"
    )
    # fenced_jobs(allocated groups, fences by group): tabulated over the groups handed out since the last step
    # and each job's fence (0: none, 1 + g: an awaited store of a finished request, reading group g), as
    # OffloadingScheduler builds the fence index; the answer is the set of jobs to flush, as a bit mask.
    finished_states = ("finished_unsignalled", "finished_signalled", "deleted")
    w("/* fenced_jobs(allocated, fences): the jobs a step must flush, tabulated over the groups allocated since")
    w("   the last step and each job's fence code (0: not fenced, 1 + g: fenced on group g) */")
    fence_values: list[int] = []
    for alloc in range(1 << G):
        allocated = [g for g in range(G) if alloc >> g & 1]
        for combo in itertools.product(range(G + 1), repeat=J):
            fences: dict[int, set[int]] = {}
            for j, c in enumerate(combo):
                if c:
                    fences.setdefault(c - 1, set()).add(j)
            flush = scheduler_mod.fenced_jobs(allocated, fences)
            fence_values.append(sum(1 << j for j in flush if 0 <= j < J))
    fence_init, fence_read = _value_table(w, "FENCETAB", fence_values, hid)
    init += fence_init
    for j in range(J):
        owner = j % R
        done = " || ".join(f"rst[{owner}] == {st('request', s)}" for s in finished_states)
        w(f"#define FENCE_{j} ((AWAITED({j}) && live[{owner}] && ({done})) -> (1 + jgroup[{j}]) : 0)")
    fidx = "galloc"
    for j in range(J):
        fidx = f"({fidx}) * {G + 1} + FENCE_{j}"
    w(f"#define FENCE_INDEX ({fidx})")
    w(f"#define FENCED {fence_read.replace('IDX', 'FENCE_INDEX')}")
    # stale_threshold_after_reset(job_counter, threshold): tabulated over every counter and threshold value
    w("/* stale_threshold_after_reset(job counter, threshold), tabulated over 0..J x 0..J */")
    sth = [
        max(0, min(255, int(scheduler_mod.stale_threshold_after_reset(n, t))))
        for n in range(J + 1)
        for t in range(J + 1)
    ]
    sth_init, sth_read = _value_table(w, "STHTAB", sth, hid)
    init += sth_init
    w(f"#define STALE_THRESHOLD {sth_read.replace('IDX', f'(njobs * {J + 1} + thr)')}")
    w()

    # ---------------------------------------------------------------- ground truth and properties
    def live_shard(j: int, r: int, codes_: str) -> str:
        # a job reset_cache discarded (stale, or timed out and dropped from the quarantine) is not pending work
        counts = f"jst[{j}] != {st('job', 'stale')} && (jst[{j}] != {st('job', 'timed_out')} || jquar[{j}])"
        return f"({counts} && ({codes_.format(c=f'cp[{j} * W + {r}]')}))"

    # as the native checker's transfer_remains: an awaited job's shard not launched, copying or unreported; a
    # job that is over (and not discarded by reset_cache) only with a launched, unreported copy
    shards = [
        f"(AWAITED({j}) && cp[{j} * W + {r}] <= 3) || " + live_shard(j, r, "{c} == 1 || {c} == 2 || {c} == 3")
        for j in range(J)
        for r in range(W)
    ]
    w("/* ground truth: a shard of a job reset_cache did not discard that is not launched (if the job is")
    w("   awaited), copying or unreported, or a cascade */")
    w("#define TRANSFER_REMAINS (" + " || ".join(f"({x})" for x in shards) + " || MGR_PENDING)")
    readable = " && ".join(
        f"(!(sst[{k}] == {st('slot', 'ready')} || sst[{k}] == {st('slot', 'reading')}) || wmask[{k}] == ALLRANKS)"
        for k in range(K)
    )
    any_awaiting = " || ".join(f"awaiting[{r}]" for r in range(R))
    flush_done = " && ".join(f"(!AWAITED({j}) || (cp[{j} * W + {r}] >= 2))" for j in range(J) for r in range(W))
    w(f"#define FLUSH_DONE ({flush_done})")
    # A store's GPU source is at risk when another request holds its group and the step writes it: an
    # awaited store with a shard not launched or copying, or a discarded one still copying.
    for j in range(J):
        busy_awaited = " || ".join(f"cp[{j} * W + {r}] <= 1" for r in range(W))
        busy_stale = " || ".join(f"cp[{j} * W + {r}] == 1" for r in range(W))
        w(
            f"#define GPU_HAZARD_{j} (jcreated[{j}] && gbusy[jgroup[{j}]] && gowner[jgroup[{j}]] != {j % R} && "
            f"((AWAITED({j}) && ({busy_awaited})) || (jst[{j}] == {st('job', 'stale')} && ({busy_stale}))))"
        )
    w("#define GPU_HAZARD (" + " || ".join(f"GPU_HAZARD_{j}" for j in range(J)) + ")")
    w("inline check_invariants() {")
    w("  assert(violated_pending_work_covers_jobs || abandoned || !TRANSFER_REMAINS || PPW);")
    w(f"  assert(violated_idle_only_when_nothing_pending || est != {st('engine', 'idle')} || !TRANSFER_REMAINS);")
    if b.shutdown:
        # stopped: no awaited job, no store's slot still reserved, no cascade pinning a slot
        stopped_clean = " && ".join(
            [
                *(f"!AWAITED({j})" for j in range(J)),
                *(f"sst[{k}] != {st('slot', 'writing')} && prom[{k}] == 0" for k in range(K)),
                *(f"!casc[{i}]" for i in range(T * K)),
            ]
        )
        w(
            f"  assert(violated_idle_only_when_nothing_pending || est != {st('engine', 'stopped')} ||"
            f" ({stopped_clean}));"
        )
    w(f"  assert(violated_readable_only_after_commit || ({readable}));")
    w("  fired = 0; eff = X_none; flushed = 0")
    w("}")
    w()
    # ---------------------------------------------------------------- the machines' rows, one inline per event
    w("/* the compiled tables: one inline per (machine, event), rows in table order, first match fires */")
    var = {"job": "jst", "slot": "sst", "request": "rst", "engine": "est"}
    for m, mach in machines.items():
        by_event: dict[str, list[tuple[str, str | None, str, str | None]]] = {}
        for (source, event), edges in mach.table().items():
            for edge in edges:
                effect = edge.effect
                if m == "engine" and event == "settle" and edge.guard == "pending_push_work":
                    # the drain mode (invariants.toml [[drain_mode]]) says what these rows carry
                    effect = None if drain_effect is None else drain_effect.value
                by_event.setdefault(event, []).append((source, edge.guard, edge.dest, effect))
        for event in mach.spec.events:
            rows = by_event.get(event, [])
            w(f"inline {m}_{event}(i, arg) {{")
            w("  fired = 0; eff = X_none;")
            for source, guard, dest, effect in rows:
                cond = f"{var[m]}[i] == {st(m, source)}" if m != "engine" else f"est == {st(m, source)}"
                if guard is not None:
                    cond += f" && {guard_macro[m, guard]}(i, arg)"
                target = f"{var[m]}[i]" if m != "engine" else "est"
                w(
                    f"  if :: !fired && {cond} -> {target} = {st(m, dest)}; eff = {_eff(effect)}; fired = 1"
                    " :: else -> skip fi;"
                )
            w("}")
    w()
    # ---------------------------------------------------------------- show_state(): the abstract state, for traces
    w("/* the abstract state after an event (printed only when spin -t replays a trail) */")
    w("inline show_state() {")
    w('  printf("ST|%e,%d,%d", est, blocked, hold);')
    for r in range(R):
        w(f'  printf("|%e,%d,%d,%d,%d", rst[{r}], arrived[{r}], queued[{r}], live[{r}], rgroup[{r}]);')
    for j in range(J):
        cps = ",".join(["%d"] * W)
        args = ", ".join(f"cp[{j * W + r}]" for r in range(W))
        w(f'  printf("|%e,%d,%d,%d,{cps}", jst[{j}], jcreated[{j}], jgroup[{j}], jid[{j}], {args});')
    for k in range(K):
        cascading = " + ".join(f"casc[{t * K + k}]" for t in range(T))
        w(f'  printf("|%e,%d,%d,%d,%d", sst[{k}], srd[{k}], wmask[{k}], {cascading}, prom[{k}]);')
    for g in range(G):
        w(f'  printf("|%d,%d", gbusy[{g}], gowner[{g}]);')
    w('  printf("|%d,%d\\n", galloc, thr)')
    w("}")
    w()
    # ---------------------------------------------------------------- flushes (a step's blocking waits)
    w("/* a flush: launch every rank's shard of job j not launched yet, then wait for every copy (it succeeds) */")
    w("inline flush_job(j, k) {")
    for r in range(W):
        w(f"  if :: cp[j * W + {r}] == 0 && AWAITED(j) -> job_launch(j, {r});")
        w(f"        if :: fired && eff == X_start_copy -> jl[j] = jl[j] | {1 << r}; cp[j * W + {r}] = 1")
        w("           :: else -> skip fi")
        w("     :: else -> skip fi;")
        w(f"  if :: cp[j * W + {r}] == 1 -> cp[j * W + {r}] = 2;")
        w(f"        if :: jst[j] != {st('job', 'stale')} -> wmask[k] = wmask[k] | {1 << r} :: else -> skip fi")
        w("     :: else -> skip fi;")
    w("}")
    w()
    slot_of = {j: (j % R) % K for j in range(J)}
    w("/* the RELEASE effect's memory part for a store: its slot's write is rolled back */")
    w(
        f"inline release_store(k) {{ if :: sst[k] == {st('slot', 'writing')} -> slot_abort_write(k, 0)"
        " :: else -> skip fi }"
    )
    w("/* time_out (expire_jobs, a bounded shutdown's give up): the job leaves the scheduler at once; its slot is")
    w("   handed back only once every launched copy has reported (quarantine), at once if none is unreported */")
    w("inline time_out_job(j, k) {")
    w("  job_time_out(j, 0);")
    w("  if :: fired && eff == X_release -> if :: UNREPORTED(j) -> jquar[j] = 1 :: else -> release_store(k) fi")
    w("     :: else -> skip fi")
    w("}")
    w()
    # the engine step: flushes, then the forward writes the groups of running and loading requests, then settle
    w("/* a step: fenced_jobs' flush for the groups handed out since the last step, the reset's flush, then the")
    w("   forward writes every held group (gpu_source_not_overwritten), then settle_event's answer */")
    w("inline engine_step() {")
    if b.deadlines:
        for j in range(J):
            w(f"  if :: jexp[{j}] && AWAITED({j}) -> time_out_job({j}, {slot_of[j]}) :: else -> skip fi;")
    w("  flushed = FENCED;")
    for j in range(J):
        w(f"  if :: (flushed >> {j}) & 1 -> flush_job({j}, {slot_of[j]}) :: else -> skip fi;")
    w("  if :: rflush ->")
    for j in range(J):
        for r in range(W):
            w(
                f"       if :: jst[{j}] == {st('job', 'stale')} && cp[{j * W + r}] == 1 -> cp[{j * W + r}] = 2"
                " :: else -> skip fi;"
            )
    w("       rflush = 0")
    w("     :: else -> skip fi;")
    w("  assert(violated_gpu_source_not_overwritten || !GPU_HAZARD);")
    for k in range(K if b.promotions else 0):  # manager.on_schedule_end: the queued promotions are submitted
        w(f"  if :: prom[{k}] == 1 -> prom[{k}] = 2 :: else -> skip fi;")
    w("  galloc = 0;")
    w("  if")
    for state in EngineState:
        for unfinished in (False, True):
            ev = settle_event(state, unfinished)
            if ev is None:
                continue
            w(
                f"  :: est == {st('engine', state.value)} && HAS_UNFINISHED == {int(unfinished)} ->"
                f" engine_{ev.value}(0, 0)"
            )
    w("  :: else -> fired = 0; eff = X_none")
    w("  fi;")
    if drain_effect is not None:
        w(f"  if :: fired && eff == {_eff(drain_effect.value)} -> blocked = 1 :: else -> skip fi;")
    w("}")
    w()
    # ---------------------------------------------------------------- processes
    # workers: one process per (job, rank)
    w("proctype worker(byte j; byte w; byte k) {")
    w("end_worker:")
    w("  do")
    w(
        f"  :: atomic {{ !hold && est != {st('engine', 'stopped')} && AWAITED(j) && cp[j * W + w] == 0 -> "
        + _ev("job J%d rank %d: launch", "j + 1", "w")
    )
    w("       job_launch(j, w);")
    w("       if :: fired && eff == X_start_copy -> jl[j] = jl[j] | (1 << w); cp[j * W + w] = 1 :: else -> skip fi;")
    w("       show_state(); check_invariants() }")
    w("  :: atomic { !hold && cp[j * W + w] == 1 -> " + _ev("job J%d rank %d: copy finishes ok", "j + 1", "w"))
    w("       cp[j * W + w] = 2;")
    w(f"       if :: jst[j] != {st('job', 'stale')} -> wmask[k] = wmask[k] | (1 << w) :: else -> skip fi;")
    w("       show_state(); check_invariants() }")
    if b.failures:
        w("  :: atomic { !hold && cp[j * W + w] == 1 -> " + _ev("job J%d rank %d: copy fails", "j + 1", "w"))
        w("       cp[j * W + w] = 3; show_state(); check_invariants() }")
    w(
        f"  :: atomic {{ !hold && !blocked && est != {st('engine', 'stopped')} &&"
        " (cp[j * W + w] == 2 || cp[j * W + w] == 3) ->"
    )
    w("       if :: cp[j * W + w] == 2 -> " + _ev("job J%d rank %d: ack", "j + 1", "w"))
    w("          :: else -> " + _ev("job J%d rank %d: fail", "j + 1", "w"))
    w("       fi;")
    # a late report of a job reset_cache discarded: ignored below the stale threshold, else the scheduler raises
    w(f"       if :: jst[j] == {st('job', 'stale')} -> assert(violated_stale_ids_ignored || jid[j] < thr)")
    # a late report of a timed-out job is absorbed by id; the last launched copy's report ends the quarantine
    w(f"          :: jst[j] == {st('job', 'timed_out')} -> cp[j * W + w] = 4;")
    w("               if :: jquar[j] && !UNREPORTED(j) -> jquar[j] = 0; release_store(k) :: else -> skip fi")
    w(f"          :: jst[j] != {st('job', 'stale')} && jst[j] != {st('job', 'timed_out')} ->")
    w("       if :: cp[j * W + w] == 2 -> job_ack(j, w) :: else -> job_fail(j, w) fi;")
    w("       if :: cp[j * W + w] == 3 -> jf[j] = jf[j] + 1 :: else -> skip fi;")
    w("       jr[j] = jr[j] | (1 << w);")
    # write-through: a commit starts the slot's cascade (the tier's copy), while the cascade budget lasts
    w("       if :: fired && eff == X_commit -> slot_commit_write(k, 0);")
    for t in range(T):
        w(
            f"             if :: ncasc < NCASC && !casc[{t} * K + k] -> slot_begin_read(k, 0); srd[k] = srd[k] + 1;"
            f" casc[{t} * K + k] = 1; ncasc = ncasc + 1"
        )
        w("                :: else -> skip fi" + (";" if t < T - 1 else ""))
    w("          :: fired && eff == X_release -> slot_abort_write(k, 0)")
    w("          :: else -> skip fi")
    w("       fi;")
    w("       cp[j * W + w] = 4;")
    w("       show_state(); check_invariants() }")
    w("  od")
    w("}")
    w()
    # requests
    w("proctype request(byte r; byte k) {")
    w("end_request:")
    w("  do")
    w(f"  :: atomic {{ !arrived[r] && est != {st('engine', 'shutting_down')} && est != {st('engine', 'stopped')} ->")
    w("       " + _ev("request R%d arrives", "r + 1"))
    w("       arrived[r] = 1; queued[r] = 1;")
    w(f"       if :: est == {st('engine', 'finishing')} || est == {st('engine', 'draining')} ->")
    w("               awaiting[r] = 1; if :: hold = 1 :: skip fi")
    w("          :: else -> skip fi;")
    w("       show_state(); check_invariants() }")
    lookup_states = " || ".join(f"rst[r] == {st('request', s)}" for s in ("tracked", "deferred", "preempted"))
    # a lookup needs a free GPU group (the engine allocates the request's blocks); any free one may be given
    for g in range(G):
        w(
            f"  :: atomic {{ live[r] && !blocked && est == {st('engine', 'running')} && ({lookup_states}) && "
            f"!gbusy[{g}] ->"
        )
        w("       " + _ev(f"the engine looks up request R%d (free GPU group g{g})", "r + 1"))
        w(f"       if :: sst[k] == {st('slot', 'ready')} || sst[k] == {st('slot', 'reading')} ->")
        w("               request_start_load(r, 0);")
        w("               if :: fired -> slot_begin_read(k, 0); srd[k] = srd[k] + 1 :: else -> skip fi")
        w(f"          :: sst[k] == {st('slot', 'writing')} -> request_defer(r, 0)")
        if b.promotions:
            # TieringManager.lookup: the first tier that holds the key answers HIT; the primary reserves the
            # slot (begin_write) for the promotion and the request defers until it commits
            for t in range(b.tiers):
                earlier = "".join(f" && !((held[{u}] >> k) & 1)" for u in range(t))
                w(
                    f"          :: sst[k] == {st('slot', 'absent')} && ((held[{t}] >> k) & 1){earlier} ->"
                    f" slot_begin_write(k, 0); wmask[k] = 0; prom[k] = 1; promt[k] = {t}; request_defer(r, 0)"
                )
            misses = "".join(f" && !((held[{t}] >> k) & 1)" for t in range(b.tiers))
            w(f"          :: sst[k] == {st('slot', 'absent')}{misses} -> request_schedule(r, 0)")
        else:
            w(f"          :: sst[k] == {st('slot', 'absent')} -> request_schedule(r, 0)")
        w("       fi;")
        w(
            f"       if :: fired && (rst[r] == {st('request', 'loading')} || rst[r] == {st('request', 'running')}) ->"
            f" gbusy[{g}] = 1; gowner[{g}] = r; rgroup[r] = {g}; galloc = galloc | {1 << g}"
        )
        w("          :: else -> skip fi;")
        w("       awaiting[r] = 0; if :: !(" + any_awaiting + ") -> hold = 0 :: else -> skip fi;")
        w("       show_state(); check_invariants() }")
    w(f"  :: atomic {{ live[r] && rst[r] == {st('request', 'loading')} && !hold ->")
    w("       " + _ev("request R%d: its load finishes", "r + 1"))
    w("       slot_end_read(k, 0); srd[k] = srd[k] - 1; request_load_done(r, 0); show_state(); check_invariants() }")
    for r in range(R):
        for j in owned[r]:
            w(
                f"  :: atomic {{ r == {r} && live[r] && rst[r] == {st('request', 'running')} && !jcreated[{j}] && "
                f"sst[k] == {st('slot', 'absent')} && njobs < 255 ->"
            )
            w("       " + _ev(f"the scheduler plans store job J{j + 1} for request R%d", "r + 1"))
            w(
                f"       slot_begin_write(k, 0); wmask[k] = 0; jcreated[{j}] = 1; jst[{j}] = {st('job', 'submitted')};"
                f" jgroup[{j}] = rgroup[r]; jid[{j}] = njobs; njobs = njobs + 1;"
            )
            w("       show_state(); check_invariants() }")
    w(f"  :: atomic {{ live[r] && rst[r] == {st('request', 'running')} ->")
    w("       " + _ev("request R%d finishes (its GPU group is freed)", "r + 1"))
    w("       request_finish(r, 0); gbusy[rgroup[r]] = 0; show_state(); check_invariants() }")
    w(f"  :: atomic {{ live[r] && rst[r] == {st('request', 'finished_unsignalled')} ->")
    w("       " + _ev("request R%d: signal", "r + 1"))
    w("       request_signal(r, 0); show_state(); check_invariants() }")
    w(f"  :: atomic {{ live[r] && rst[r] == {st('request', 'finished_signalled')} && g_request_no_jobs(r, 0) ->")
    w("       " + _ev("request R%d: delete", "r + 1"))
    w("       request_delete(r, 0); show_state(); check_invariants() }")
    w("  od")
    w("}")
    w()
    # manager: cascades and eviction
    w("proctype manager() {")
    w("end_manager:")
    w("  do")
    for j in range(J if b.deadlines else 0):
        w(
            f"  :: atomic {{ nexp < NDEADLINES && AWAITED({j}) && !jexp[{j}] -> "
            + _ev(f"the deadline of job J{j + 1} passes")
        )
        w(f"       jexp[{j}] = 1; nexp = nexp + 1; show_state(); check_invariants() }}")
    for k in range(K):
        for t in range(T):
            cv = f"casc[{t * K + k}]"
            outcomes = [("ok", True), ("fails", False)] if b.failures and b.promotions else [("ok", True)]
            for word, ok in outcomes:
                # the tier's I/O ends and the manager polls it: the primary copy is unpinned either way; the
                # tier holds the data only when its write succeeded
                keep = f" held[{t}] = held[{t}] | {1 << k};" if ok and b.promotions else ""
                w(f"  :: atomic {{ {cv} && !hold -> " + _ev(f"tier {t}'s cascade of slot s{k} finishes {word}"))
                w(
                    f"       slot_end_read({k}, 0); srd[{k}] = srd[{k}] - 1; {cv} = 0;{keep}"
                    " show_state(); check_invariants() }"
                )
        if b.promotions:
            # the promotion's I/O ends and the manager polls it: its job commits (the slot becomes readable, with
            # the data the tier held) or releases it, and a failed promotion invalidates the tier's copy (#49176)
            w(f"  :: atomic {{ prom[{k}] == 2 && !hold -> " + _ev(f"the promotion into slot s{k} finishes ok"))
            w(f"       slot_commit_write({k}, 0);")
            w(f"       if :: (held[promt[{k}]] >> {k}) & 1 -> wmask[{k}] = ALLRANKS :: else -> skip fi;")
            w(f"       prom[{k}] = 0; show_state(); check_invariants() }}")
            if b.failures:
                w(f"  :: atomic {{ prom[{k}] == 2 && !hold -> " + _ev(f"the promotion into slot s{k} fails"))
                w(f"       slot_abort_write({k}, 0); held[promt[{k}]] = held[promt[{k}]] & {255 ^ (1 << k)};")
                w(f"       prom[{k}] = 0; show_state(); check_invariants() }}")
        w(
            f"  :: atomic {{ sst[{k}] != {st('slot', 'absent')} && EVICTABLE({k}) -> "
            + _ev(f"the manager evicts slot s{k}")
        )
        w(f"       slot_evict({k}, 0);")
        w("       assert(violated_evict_only_ready_unreferenced || fired);")
        w(f"       srd[{k}] = 0; show_state(); check_invariants() }}")
    w("  od")
    w("}")
    w()
    # engine: admit from the input queue between steps, steps (with settle_event's answer), preempt, reset
    engine_up = f"est != {st('engine', 'shutting_down')} && est != {st('engine', 'stopped')}"
    stepping = " || ".join(f"est == {st('engine', s)}" for s in ("running", "finishing", "draining"))
    w("proctype engine() {")
    w("end_engine:")
    w("  do")
    for r in range(R):
        w(f"  :: atomic {{ !blocked && queued[{r}] && {engine_up} -> " + _ev(f"the engine admits request R{r + 1}"))
        w(
            f"       queued[{r}] = 0; live[{r}] = 1; rst[{r}] = {st('request', 'tracked')};"
            " show_state(); check_invariants() }"
        )
    w(f"  :: atomic {{ !blocked && est == {st('engine', 'idle')} && HAS_UNFINISHED -> " + _ev("the engine wakes up"))
    w("       engine_admit(0, 0); show_state(); check_invariants() }")
    # a running engine with unfinished requests steps only when a batch is open (else the step changes nothing)
    w(f"  :: atomic {{ !blocked && ({stepping}) && (est != {st('engine', 'running')} || !HAS_UNFINISHED || galloc) ->")
    w("       " + _ev("the engine runs a step"))
    w("       engine_step(); show_state(); check_invariants() }")
    running_live = f"est == {st('engine', 'running')}"
    for r in range(R):
        w(
            f"  :: atomic {{ !blocked && {running_live} && npreempt < NPREEMPT && galloc == 0 && live[{r}] && "
            f"rst[{r}] == {st('request', 'running')} ->"
        )
        w("       " + _ev(f"the engine preempts request R{r + 1} in a step (its GPU group is freed)"))
        w(f"       gbusy[rgroup[{r}]] = 0; npreempt = npreempt + 1;")
        for j in owned[r]:
            w(f"       if :: AWAITED({j}) -> flush_job({j}, {slot_of[j]}) :: else -> skip fi;")
        w(f"       request_preempt({r}, 0);")
        w("       engine_step(); show_state(); check_invariants() }")
    # reset_cache: the tiers drain, every awaited job is discarded (stale), the threshold rises, slots reset
    w(f"  :: atomic {{ !blocked && {engine_up} && nresets < NRESETS && galloc == 0 -> " + _ev("reset_cache"))
    w("       nresets = nresets + 1;")
    # TieringManager.reset_cache: every tier drains (its cascades finish ok), queued promotions are dropped
    for t in range(T):
        for k in range(K):
            keep = f"; held[{t}] = held[{t}] | {1 << k}" if b.promotions else ""
            w(
                f"       if :: casc[{t * K + k}] -> slot_end_read({k}, 0); srd[{k}] = srd[{k}] - 1;"
                f" casc[{t * K + k}] = 0{keep} :: else -> skip fi;"
            )
    for k in range(K if b.promotions else 0):
        w(f"       prom[{k}] = 0;")
    w("       thr = STALE_THRESHOLD;")
    for j in range(J):
        w(f"       if :: jid[{j}] < thr -> jquar[{j}] = 0 :: else -> skip fi;")
    for j in range(J):
        w(f"       if :: AWAITED({j}) -> job_discard({j}, 0); rflush = 1 :: else -> skip fi;")
    reset_req = ("loading", "finished_unsignalled", "finished_signalled")
    for r in range(R):
        cond = " || ".join(f"rst[{r}] == {st('request', s)}" for s in reset_req)
        w(f"       if :: live[{r}] && ({cond}) -> request_reset({r}, 0) :: else -> skip fi;")
    for k in range(K):
        w(
            f"       if :: sst[{k}] != {st('slot', 'absent')} -> slot_reset({k}, 0); srd[{k}] = 0; wmask[{k}] = 0"
            " :: else -> skip fi;"
        )
    w("       show_state(); check_invariants() }")
    if b.shutdown:
        unfinished_r = ("tracked", "deferred", "loading", "running", "preempted")
        w(f"  :: atomic {{ !blocked && {engine_up} && galloc == 0 -> " + _ev("shutdown: every live request is aborted"))
        for r in range(R):
            cond = " || ".join(f"rst[{r}] == {st('request', x)}" for x in unfinished_r)
            w(f"       if :: live[{r}] && ({cond}) ->")
            w(
                f"             if :: rst[{r}] == {st('request', 'running')} -> gbusy[rgroup[{r}]] = 0"
                " :: else -> skip fi;"
            )
            w(f"             request_finish({r}, 0)")
            w("          :: else -> skip fi;")
            w(f"       queued[{r}] = 0; awaiting[{r}] = 0;")
        w("       hold = 0; engine_shutdown(0, 0); show_state(); check_invariants() }")
        shutting = f"est == {st('engine', 'shutting_down')}"
        # flush_all waits (the workers and the manager keep running) until nothing is pending: stop, or the
        # deadline passes first: give up (abandon_jobs, abandon_transfers)
        w(f"  :: atomic {{ {shutting} && PPW && !abandoned -> " + _ev("the shutdown deadline passes: give up"))
        for j in range(J):
            w(f"       if :: AWAITED({j}) && jl[{j}] == 0 -> job_cancel({j}, 0);")
            w(f"             if :: fired && eff == X_release -> release_store({slot_of[j]}) :: else -> skip fi")
            w(f"          :: AWAITED({j}) && jl[{j}] != 0 -> time_out_job({j}, {slot_of[j]})")
            w("          :: else -> skip fi;")
        w("       abandoned = 1; show_state(); check_invariants() }")
        w(f"  :: atomic {{ {shutting} && !PPW -> " + _ev("stop: the quarantine and the tiers' pins are handed back"))
        w("       engine_stop(0, 0);")
        for j in range(J):
            w(
                f"       if :: jquar[{j}] -> jquar[{j}] = 0; release_store({slot_of[j]})"
                + "".join(f"; if :: cp[{j * W + r}] >= 1 -> cp[{j * W + r}] = 4 :: else -> skip fi" for r in range(W))
                + " :: else -> skip fi;"
            )
        for t in range(T):
            for k in range(K):
                w(
                    f"       if :: casc[{t * K + k}] -> slot_end_read({k}, 0); srd[{k}] = srd[{k}] - 1;"
                    f" casc[{t * K + k}] = 0 :: else -> skip fi;"
                )
        for k in range(K if b.promotions else 0):
            w(
                f"       if :: prom[{k}] != 0 -> prom[{k}] = 0; if :: sst[{k}] == {st('slot', 'writing')} ->"
                f" slot_abort_write({k}, 0) :: else -> skip fi :: else -> skip fi;"
            )
        w("       show_state(); check_invariants() }")
    w("  :: atomic { blocked && FLUSH_DONE -> " + _ev("flush_all's wait returns"))
    w("       blocked = 0; show_state(); check_invariants() }")
    w("  od")
    w("}")
    w()
    # responsiveness, and that the composition never gets stuck: checked when nothing else can move
    w("/* at the end (nothing can move): no request still waits for its first lookup while a GPU group is free.")
    w("   After an arrival while draining, completions are held (hold), so a lookup that needs one never comes:")
    w("   the #42611 wait. (A request that waits for GPU memory held by a loading request waits for memory,")
    w("   not for the drain: the engine could not schedule it either.) */")
    group_free = " || ".join(f"!gbusy[{g}]" for g in range(G))
    w("active proctype monitor() {")
    w("  timeout -> " + _ev("nothing else can move") + ";")
    w(f"  assert(violated_responsiveness || !(({any_awaiting}) && ({group_free})))")
    w("}")
    w()
    if b.liveness:
        w("/* liveness: no draining forever (under weak fairness: pan -a -f) */")
        w(f"#define DRAINING (est == {st('engine', 'finishing')} || est == {st('engine', 'draining')})")
        w("ltl liveness { [] (DRAINING -> <> !DRAINING) }")
        w()
    w("init {")
    w("  atomic {")
    for j in range(J):
        w(f"    jst[{j}] = {st('job', jm.spec.initial)};")
    for k in range(K):
        w(f"    sst[{k}] = {st('slot', sm.spec.initial)};")
    for r in range(R):
        w(f"    rst[{r}] = {st('request', rm.spec.initial)};")
    w(f"    est = {st('engine', em.spec.initial)};")
    for stmt in init:
        w(f"    {stmt};")
    w("    show_state();")
    for j in range(J):
        for r in range(W):
            w(f"    run worker({j}, {r}, {slot_of[j]});")
    for r in range(R):
        w(f"    run request({r}, {r % K});")
    w("    run manager();")
    w("    run engine()")
    w("  }")
    w("}")
    return w.text()
