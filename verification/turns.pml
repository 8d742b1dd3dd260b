/*
 * turns.pml: the life of a turn across agent restarts (docs/verification.md).
 *
 * One session, N user messages its client submits in order (keys make each inserted at most
 * once, agent.pml proves that; here a message is inserted when the client's prompt, or its
 * retry after a restart, reaches a live process). Agent processes run one after the other:
 * each may die (a fault) at any step, losing what it held in memory (its turn queue), and the
 * next one starts from the store. What the store keeps per message: inserted, its end records
 * (A10: `ends`), the private markers (A3): "run again" (`rerun`), "queued" behind another turn
 * (`queued`) and "started" (`started`, stored before a queued turn runs); how often its turn
 * was started (`runs`) is the model's bookkeeping.
 *
 * A process: recovery first (every inserted message without an end record is simply run when
 * its markers show it never started; otherwise reported, an end record `error` stored, or under
 * POLICY=CONTINUE run again once, its marker stored first);
 * then it inserts the client's next prompt (hold: when no turn runs or waits; steer: at any
 * time, its turn queued) and runs the queued turns in order, each ended by its end record. A
 * `session/cancel` (at most once) cancels the running turn and drops the queued ones; every
 * one of them gets its end record `cancelled`, the running turn's first.
 *
 * Checked: an end record is never written twice for a message; a turn is started only when
 * its message has no end record; under report a turn runs at most once, under continue at most
 * twice (run again once); once the last process has finished, every message was inserted and
 * has exactly one end record.
 *
 *   spin -a [-DPOLICY=1] [-DFAULTS=n] turns.pml; gcc -DSAFETY -o pan pan.c; ./pan
 *
 * Mutants (-DMUTANT_X), each a guard removed, each must give a counterexample:
 *   REPORT_UNSTORED  the interrupted outcome only told, never stored (said once, then gone)
 *   RERUN_ENDED      recovery ignores end records: an ended turn is reported or run again
 *   RERUN_UNMARKED   continue runs a turn again without storing its marker first
 *   DROPPED_UNENDED  a cancel drops queued turns without their end records
 *   DROPPED_KEPT     a cancel ends the queued turns but leaves them queued: they run after
 *   START_UNMARKED   a queued turn runs without its "started" marker stored first
 */

#ifndef N
#define N 2
#endif
#ifndef FAULTS
#define FAULTS 2
#endif
#define REPORT 0
#define CONTINUE 1
#ifndef POLICY
#define POLICY REPORT
#endif
#define NONE 255

bool inserted[N];
byte ends[N];       /* end records stored for the message */
bool rerun[N];      /* the private "run again" marker */
bool queued[N];     /* the private "queued" marker */
bool started[N];    /* the private "started" marker */
byte runs[N];       /* how often its turn started (bookkeeping) */
byte faults = 0;
bool steer;         /* the held-prompt policy, chosen once */
bool cancelled = false;

/* one process's memory */
byte queue[N];
byte qlen = 0;
byte running = NONE;
byte next = 0;      /* the client's next prompt to insert */

inline fault() {
    if
    :: faults < FAULTS -> faults++; goto died
    :: true -> skip
    fi
}

inline write_end(m) {
    assert(ends[m] == 0);  /* a message's turn ends once in the history */
    ends[m]++
}

inline push(m) {
    queue[qlen] = m;
    qlen++
}

inline pop(m) {
    m = queue[0];
    k = 0;
    do
    :: k + 1 < qlen -> queue[k] = queue[k + 1]; k++
    :: else -> break
    od;
    qlen--
}

active proctype Agents() {
    byte m;
    byte k;
    if
    :: steer = true
    :: steer = false
    fi;
start:
    qlen = 0;
    running = NONE;
    /* recovery: every inserted message without an end record, once, in order */
    m = 0;
    do
    :: m < N ->
        if
#ifdef MUTANT_RERUN_ENDED
        :: inserted[m] ->
#else
        :: inserted[m] && ends[m] == 0 ->
#endif
            if
            :: queued[m] && !started[m] -> push(m)  /* never started: simply run */
#ifdef MUTANT_RERUN_UNMARKED
            :: POLICY == CONTINUE -> push(m)
#else
            :: POLICY == CONTINUE && !rerun[m] -> rerun[m] = true; fault(); push(m)
#endif
            :: else ->
#ifndef MUTANT_REPORT_UNSTORED
                write_end(m);
#endif
                fault()
            fi
        :: else -> skip
        fi;
        m++
    :: else -> break
    od;
    /* work */
    do
    :: running == NONE && qlen > 0 ->
        pop(m);
#ifndef MUTANT_START_UNMARKED
        if
        :: queued[m] -> started[m] = true; fault()
        :: else -> skip
        fi;
#endif
        assert(ends[m] == 0);  /* never start a turn that ended */
        runs[m]++;
        assert(POLICY == CONTINUE || runs[m] <= 1);  /* report: never run again */
        assert(runs[m] <= 2);  /* continue: run again at most once */
        running = m;
        fault()
    :: running != NONE ->
        write_end(running);
        running = NONE;
        fault()
    :: running != NONE && !cancelled ->
        /* session/cancel: the running turn ends cancelled, then each dropped queued one */
        cancelled = true;
        write_end(running);
        running = NONE;
        fault();
        do
        :: qlen > 0 ->
#ifdef MUTANT_DROPPED_KEPT
            write_end(queue[qlen - 1]);
            break
#else
            qlen--;
#ifndef MUTANT_DROPPED_UNENDED
            write_end(queue[qlen]);
#endif
            fault()
#endif
        :: else -> break
        od
    :: next < N && (steer || (running == NONE && qlen == 0)) ->
        /* the message and its key in one transaction, then its turn queued */
        inserted[next] = true;
        if
        :: running != NONE || qlen > 0 ->
            /* behind a turn: its marker is a write of its own, after the commit */
            push(next);
            next++;
            fault();
            queued[queue[qlen - 1]] = true
        :: else ->
            push(next);
            next++
        fi;
        fault()
    :: next == N && running == NONE && qlen == 0 -> break
    od;
    /* the last process finished: every message inserted, its turn ended once */
    m = 0;
    do
    :: m < N -> assert(inserted[m] && ends[m] == 1); m++
    :: else -> break
    od;
    goto finished;
died:
    goto start;
finished:
    skip
}
