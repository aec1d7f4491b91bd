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
  over every combination of the jobs' awaited/pending counts and the manager's cascades), ``is_evictable``
  (the CPU tier's eviction choice) and ``settle_event`` (the engine's end-of-step decision).

The composition around them is generic and driven by the bounds: ``J`` store jobs copied by ``W`` ranks
(per-rank launch, copy, report, the spec's per-rank ack rule in the job guards), ``K`` slots, ``R`` requests
(arrival, lookup, load, store, finish, signal, delete), a manager that cascades committed slots and evicts,
one engine whose steps fire ``settle_event``'s answer. Properties come from ``spec/invariants.toml`` where
they are expressible as assertions at every atomic step; spec/README.md, "SPIN export", lists what is
covered and what is abstracted away.
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
MAX_PROMELA_BOUNDS: dict[str, int] = {"jobs": 6, "ranks": 4, "slots": 6, "requests": 6, "cascades": 6}

#: The properties the generated model asserts, each by the name of the spec entry it expresses
#: (``spec/invariants.toml``). Every assertion names its property through a never-set hidden flag, so
#: that pan's "assertion violated" line says which one failed.
PROPERTIES: tuple[str, ...] = (
    "pending_work_covers_jobs",
    "idle_only_when_nothing_pending",
    "readable_only_after_commit",
    "evict_only_ready_unreferenced",
    "responsiveness",
    "liveness",
)


@dataclass(frozen=True, slots=True)
class PromelaBounds:
    """The generated composition's bounds: ``jobs`` store jobs x ``ranks`` workers, ``slots`` CPU slots,
    ``requests`` requests, at most ``cascades`` cascades in all, and the engine's drain mode."""

    jobs: int = 2
    ranks: int = 2
    slots: int = 1
    requests: int = 2
    cascades: int = 1
    failures: bool = True
    drain: DrainMode = DrainMode.NON_BLOCKING
    liveness: bool = False  #: also emit the LTL liveness claim (run pan with -a -f, not -DSAFETY)

    def __post_init__(self) -> None:
        for name, hi in MAX_PROMELA_BOUNDS.items():
            value = getattr(self, name)
            lo = 0 if name == "cascades" else 1
            if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
                raise ConfigError(f"promela bound {name} = {value!r}; expected an integer from {lo} to {hi}")

    def as_dict(self) -> dict[str, object]:
        return {
            "jobs": self.jobs,
            "ranks": self.ranks,
            "slots": self.slots,
            "requests": self.requests,
            "cascades": self.cascades,
            "failures": self.failures,
            "drain": self.drain.value,
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


def _table_array(w: _Writer, name: str, values: list[bool]) -> list[str]:
    """Declare a hidden bit array; return the init statements that set its true entries."""
    w(f"hidden byte {name}[{len(values)}];")
    return [f"{name}[{i}] = 1" for i in _bits(values)]


# ------------------------------------------------------------------------------------------- generator


def generate(bounds: PromelaBounds | None = None) -> str:
    """The Promela model for ``bounds``, from the spec tables and the shared decisions as they are now
    (planted bugs included)."""
    b = bounds or PromelaBounds()
    jm, sm, rm, em = job_machine(), slot_machine(), request_machine(), engine_machine()
    machines: dict[str, SpecMachine[Any, Any, Any]] = {
        "job": jm,
        "slot": sm,
        "request": rm,
        "engine": em,
    }
    J, W, K, R = b.jobs, b.ranks, b.slots, b.requests
    M = 1 << W
    ALL = M - 1
    max_readers = R + K  # every request loading one slot, every slot cascading once
    drain_effect = load_drain_modes()[b.drain].settle_effect
    w = _Writer()
    init: list[str] = []

    w(f"/* kvfsm: generated by kvfsm.check.promela from spec/*.toml; bounds {b.as_dict()} */")
    w("/* Do not edit: regenerate with `kvfsm export promela`. */")
    w(f"#define J {J}")
    w(f"#define W {W}")
    w(f"#define K {K}")
    w(f"#define R {R}")
    w(f"#define ALLRANKS {ALL}")
    w(f"#define NCASC {b.cascades}")
    # ---------------------------------------------------------------- mtypes: states and effects
    names: list[str] = []
    for m, mach in machines.items():
        names += [_st(m, s) for s in mach.spec.states]
    effects = sorted({e for mach in machines.values() for e in mach.spec.effects})
    names += ["X_none", *(_eff(e) for e in effects)]
    w(f"mtype = {{ {', '.join(names)} }};")
    w()
    # ---------------------------------------------------------------- composition variables
    w("/* job j: owned by request j % R, writes the slot of its owner's chunk */")
    w("mtype jst[J];            /* job machine state */")
    w("bit jcreated[J];         /* planned by the scheduler */")
    w("byte jl[J];              /* launched_mask */")
    w("byte jr[J];              /* reported_mask */")
    w("byte jf[J];              /* failed_reports */")
    w("byte cp[J * W];          /* rank w's shard of job j: 0 none, 1 copying, 2 done ok, 3 done failed, 4 reported */")
    w("mtype sst[K];            /* slot machine state */")
    w("byte srd[K];             /* slot readers */")
    w("byte wmask[K];           /* ground truth: ranks whose shard of the slot's current write finished ok */")
    w("bit casc[K];             /* a cascade (manager transfer) reads the slot */")
    w("byte ncasc;              /* cascades started, in all */")
    w("mtype rst[R];            /* request machine state */")
    w("bit arrived[R];          /* arrived in the engine's input queue */")
    w("bit queued[R];           /* arrived, not admitted yet */")
    w("bit live[R];             /* admitted: the request machine runs */")
    w("bit awaiting[R];         /* arrived while finishing/draining, not looked up yet */")
    w("bit hold;                /* responsiveness: after such an arrival, no copy or cascade completes */")
    w("bit blocked;             /* blocking drain: the step waits inside flush_all */")
    w("mtype est;               /* engine machine state */")
    w("hidden byte fired;")
    w("hidden mtype eff;")
    w("hidden byte hu;")
    for p in PROPERTIES:
        w(f"hidden byte violated_{p};  /* never set: names the property in pan's assertion message */")
    w()
    # ---------------------------------------------------------------- guards as truth tables
    w("/* guards: truth tables of the bound guard functions over their model's variables */")
    guard_macro: dict[tuple[str, str], str] = {}
    for gname, fn in jm.guards.items():
        values = []
        for lm, rmask, nf, rank in itertools.product(range(M), range(M), range(W + 1), range(W)):
            values.append(bool(fn(_JobProbe(None, W, lm, rmask, nf), rank)))
        init += _table_array(w, f"G_job_{gname}", values)
        w(f"#define g_job_{gname}(j, r) (G_job_{gname}[((jl[j] * {M} + jr[j]) * {W + 1} + jf[j]) * {W} + (r)])")
        guard_macro["job", gname] = f"g_job_{gname}"
    for gname, fn in sm.guards.items():
        values = [bool(fn(_SlotProbe(None, n), 0)) for n in range(max_readers + 1)]
        init += _table_array(w, f"G_slot_{gname}", values)
        w(f"#define g_slot_{gname}(k, r) (G_slot_{gname}[srd[k]])")
        guard_macro["slot", gname] = f"g_slot_{gname}"
    for gname, fn in rm.guards.items():
        values = [bool(fn(_RequestProbe(None, hj), 0)) for hj in (False, True)]
        init += _table_array(w, f"G_request_{gname}", values)
        w(f"#define g_request_{gname}(i, r) (G_request_{gname}[HAS_JOBS(i)])")
        guard_macro["request", gname] = f"g_request_{gname}"
    for gname, fn in em.guards.items():
        values = [bool(fn(_EngineProbe(None, p), 0)) for p in (False, True)]
        init += _table_array(w, f"G_engine_{gname}", values)
        w(f"#define g_engine_{gname}(i, r) (G_engine_{gname}[PPW])")
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
    init += _table_array(w, "PPWTAB", ppw_values)
    popcount = " + ".join(f"((jr[j] >> {i}) & 1)" for i in range(W))
    w("#define AWAITED(j) (jcreated[j] && (jst[j] == J_submitted || jst[j] == J_in_flight))")
    w(f"#define JCODE(j) (AWAITED(j) -> (1 + W - ({popcount})) : 0)")
    w("#define MGR_PENDING (" + " || ".join(f"casc[{k}]" for k in range(K)) + ")")
    # index: the job codes in mixed radix, job 0 most significant, then the manager bit
    idx = "0"
    for j in range(J):
        idx = f"({idx}) * {codes} + JCODE({j})"
    w(f"#define PPW (PPWTAB[({idx}) * 2 + MGR_PENDING])")
    evictable = [bool(cpu_mod.is_evictable(SlotState(s))) for s in sm.spec.states]
    w("/* is_evictable(slot state), by the order of the slot states */")
    for s, can_evict in zip(sm.spec.states, evictable, strict=True):
        w(f"#define EVICTABLE_{s} {int(can_evict)}")
    w(
        "#define EVICTABLE(k) ("
        + " || ".join(f"(sst[k] == {_st('slot', s)} && EVICTABLE_{s})" for s in sm.spec.states)
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
            + " || ".join(f"rst[{r}] == {_st('request', s)}" for s in unfinished_states)
            + "))"
            for r in range(R)
        )
        + ")"
    )
    w()
    # ---------------------------------------------------------------- ground truth and properties
    shards = [
        f"(cp[{j} * W + {r}] == 1 || cp[{j} * W + {r}] == 2 || cp[{j} * W + {r}] == 3)"
        for j in range(J)
        for r in range(W)
    ]
    w("/* ground truth: a launched, unreported per-rank copy, or a cascade, remains */")
    w("#define TRANSFER_REMAINS (" + " || ".join(shards) + " || MGR_PENDING)")
    unlaunched = [f"(jcreated[{j}] && cp[{j} * W + {r}] == 0)" for j in range(J) for r in range(W)]
    w("#define SHARD_REMAINS (" + " || ".join(unlaunched) + " || TRANSFER_REMAINS)")
    readable = " && ".join(
        f"(!(sst[{k}] == {_st('slot', 'ready')} || sst[{k}] == {_st('slot', 'reading')}) || wmask[{k}] == ALLRANKS)"
        for k in range(K)
    )
    any_awaiting = " || ".join(f"awaiting[{r}]" for r in range(R))
    flush_done = " && ".join(f"(!AWAITED({j}) || (cp[{j} * W + {r}] >= 2))" for j in range(J) for r in range(W))
    w(f"#define FLUSH_DONE ({flush_done})")
    w("inline check_invariants() {")
    w("  assert(!TRANSFER_REMAINS || PPW || violated_pending_work_covers_jobs);")
    w(f"  assert(!(est == {_st('engine', 'idle')}) || !SHARD_REMAINS || violated_idle_only_when_nothing_pending);")
    w(f"  assert(({readable}) || violated_readable_only_after_commit)")
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
                cond = f"{var[m]}[i] == {_st(m, source)}" if m != "engine" else f"est == {_st(m, source)}"
                if guard is not None:
                    cond += f" && {guard_macro[m, guard]}(i, arg)"
                target = f"{var[m]}[i]" if m != "engine" else "est"
                w(
                    f"  if :: !fired && {cond} -> {target} = {_st(m, dest)}; eff = {_eff(effect)}; fired = 1"
                    " :: else -> skip fi;"
                )
            w("}")
    w()
    # ---------------------------------------------------------------- processes
    slot_of = {j: (j % R) % K for j in range(J)}
    # workers: one process per (job, rank)
    w("proctype worker(byte j; byte w; byte k) {")
    w("end_worker:")
    w("  do")
    w("  :: atomic { AWAITED(j) && cp[j * W + w] == 0 -> job_launch(j, w);")
    w("       if :: fired && eff == X_start_copy -> jl[j] = jl[j] | (1 << w); cp[j * W + w] = 1 :: else -> skip fi;")
    w("       check_invariants() }")
    w(
        "  :: atomic { !hold && cp[j * W + w] == 1 -> cp[j * W + w] = 2; wmask[k] = wmask[k] | (1 << w);"
        " check_invariants() }"
    )
    if b.failures:
        w("  :: atomic { !hold && cp[j * W + w] == 1 -> cp[j * W + w] = 3; check_invariants() }")
    w("  :: atomic { !hold && !blocked && (cp[j * W + w] == 2 || cp[j * W + w] == 3) ->")
    w("       if :: cp[j * W + w] == 2 -> job_ack(j, w) :: else -> job_fail(j, w) fi;")
    w("       if :: cp[j * W + w] == 3 -> jf[j] = jf[j] + 1 :: else -> skip fi;")
    w("       jr[j] = jr[j] | (1 << w); cp[j * W + w] = 4;")
    # write-through: a commit starts the slot's cascade (the tier's copy), while the cascade budget lasts
    w("       if :: fired && eff == X_commit -> slot_commit_write(k, 0);")
    w(
        "             if :: ncasc < NCASC && !casc[k] -> slot_begin_read(k, 0); srd[k] = srd[k] + 1;"
        " casc[k] = 1; ncasc = ncasc + 1"
    )
    w("                :: else -> skip fi")
    w("          :: fired && eff == X_release -> slot_abort_write(k, 0)")
    w("          :: else -> skip fi;")
    w("       check_invariants() }")
    w("  od")
    w("}")
    w()
    # requests
    w("proctype request(byte r; byte k) {")
    w("end_request:")
    w("  do")
    w(f"  :: atomic {{ !arrived[r] && est != {_st('engine', 'shutting_down')} && est != {_st('engine', 'stopped')} ->")
    w("       arrived[r] = 1; queued[r] = 1;")
    w(f"       if :: est == {_st('engine', 'finishing')} || est == {_st('engine', 'draining')} ->")
    w("               awaiting[r] = 1; if :: hold = 1 :: skip fi")
    w("          :: else -> skip fi;")
    w("       check_invariants() }")
    lookup_states = " || ".join(f"rst[r] == {_st('request', s)}" for s in ("tracked", "deferred", "preempted"))
    w(f"  :: atomic {{ live[r] && !blocked && est == {_st('engine', 'running')} && ({lookup_states}) ->")
    w(f"       if :: sst[k] == {_st('slot', 'ready')} || sst[k] == {_st('slot', 'reading')} ->")
    w(
        "               request_start_load(r, 0);"
        " if :: fired -> slot_begin_read(k, 0); srd[k] = srd[k] + 1 :: else -> skip fi"
    )
    w(f"          :: sst[k] == {_st('slot', 'writing')} -> request_defer(r, 0)")
    w(f"          :: sst[k] == {_st('slot', 'absent')} -> request_schedule(r, 0)")
    w("       fi;")
    w("       awaiting[r] = 0; if :: !(" + any_awaiting + ") -> hold = 0 :: else -> skip fi;")
    w("       check_invariants() }")
    w(f"  :: atomic {{ live[r] && rst[r] == {_st('request', 'loading')} && !hold ->")
    w("       slot_end_read(k, 0); srd[k] = srd[k] - 1; request_load_done(r, 0); check_invariants() }")
    for r in range(R):
        for j in owned[r]:
            w(
                f"  :: atomic {{ r == {r} && live[r] && rst[r] == {_st('request', 'running')} && !jcreated[{j}] && "
                f"sst[k] == {_st('slot', 'absent')} ->"
            )
            w(f"       slot_begin_write(k, 0); wmask[k] = 0; jcreated[{j}] = 1; jst[{j}] = {_st('job', 'submitted')};")
            w("       check_invariants() }")
    w(f"  :: atomic {{ live[r] && rst[r] == {_st('request', 'running')} -> request_finish(r, 0); check_invariants() }}")
    w(
        f"  :: atomic {{ live[r] && rst[r] == {_st('request', 'finished_unsignalled')} -> request_signal(r, 0);"
        " check_invariants() }"
    )
    w(f"  :: atomic {{ live[r] && rst[r] == {_st('request', 'finished_signalled')} && g_request_no_jobs(r, 0) ->")
    w("       request_delete(r, 0); check_invariants() }")
    w("  od")
    w("}")
    w()
    # manager: cascades and eviction
    w("proctype manager() {")
    w("end_manager:")
    w("  do")
    for k in range(K):
        w(
            f"  :: atomic {{ casc[{k}] && !hold -> slot_end_read({k}, 0); srd[{k}] = srd[{k}] - 1; casc[{k}] = 0;"
            " check_invariants() }"
        )
        w(f"  :: atomic {{ sst[{k}] != {_st('slot', 'absent')} && EVICTABLE({k}) -> slot_evict({k}, 0);")
        w("       assert(fired || violated_evict_only_ready_unreferenced);")
        w(f"       srd[{k}] = 0; check_invariants() }}")
    w("  od")
    w("}")
    w()
    # engine: admit from the input queue between steps, then the end-of-step decision (settle_event)
    w("proctype engine() {")
    w("end_engine:")
    w("  do")
    for r in range(R):
        w(
            f"  :: atomic {{ !blocked && queued[{r}] && est != {_st('engine', 'shutting_down')}"
            f" && est != {_st('engine', 'stopped')} ->"
        )
        w(f"       queued[{r}] = 0; live[{r}] = 1; rst[{r}] = {_st('request', 'tracked')}; check_invariants() }}")
    for state in EngineState:
        for unfinished in (False, True):
            ev = settle_event(state, unfinished)
            if ev is None:
                continue
            w(
                f"  :: atomic {{ !blocked && est == {_st('engine', state.value)}"
                f" && HAS_UNFINISHED == {int(unfinished)} ->"
            )
            w(f"       engine_{ev.value}(0, 0);")
            if drain_effect is not None:
                w(f"       if :: fired && eff == {_eff(drain_effect.value)} -> blocked = 1 :: else -> skip fi;")
            w("       check_invariants() }")
    w("  :: atomic { blocked && FLUSH_DONE -> blocked = 0; check_invariants() }")
    w("  od")
    w("}")
    w()
    # responsiveness, and that the composition never gets stuck: checked when nothing else can move
    w("/* at the end (nothing can move): no request still waits for its first lookup. After an arrival while")
    w("   draining, completions are held (hold), so a lookup that needs one never comes: the #42611 wait. */")
    w("active proctype monitor() {")
    w("  timeout -> assert(!(" + any_awaiting + ") || violated_responsiveness)")
    w("}")
    w()
    if b.liveness:
        w("/* liveness: no draining forever (under weak fairness: pan -a -f) */")
        w(f"#define DRAINING (est == {_st('engine', 'finishing')} || est == {_st('engine', 'draining')})")
        w("ltl liveness { [] (DRAINING -> <> !DRAINING) }")
        w()
    w("init {")
    w("  atomic {")
    for j in range(J):
        w(f"    jst[{j}] = {_st('job', jm.spec.initial)};")
    for k in range(K):
        w(f"    sst[{k}] = {_st('slot', sm.spec.initial)};")
    for r in range(R):
        w(f"    rst[{r}] = {_st('request', rm.spec.initial)};")
    w(f"    est = {_st('engine', em.spec.initial)};")
    for stmt in init:
        w(f"    {stmt};")
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
