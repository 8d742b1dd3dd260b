/*
 * agent.pml: one SessionAgent, two sessions, clients that retry with the same key.
 *
 * What each action stands for in src/ is named in its comment. The agent is one process
 * (one event loop: each `atomic` is the code between two awaits); every step an `await`
 * separates in the code is a separate step here, so the crash (SIGKILL) and the faults can
 * fall between any two of them, and a request's handler can be cancelled (its connection
 * closed) at each of its awaits: waiting for the session lock, the key lookup, the insert
 * (its write queued in group commit: withdrawn, the prompt ended -32800 with its key unused;
 * or taken into a batch: the batch's outcome first), the wait for the outcome.
 *
 * Bounds: NK=3 submissions: k=0 and k=1 in session 0 (keys "a" and "b"), k=2 in session 1
 * with key "a" again (keys are scoped per session). Client 0 has 2 request slots (a resend on
 * a new connection may overlap an open attempt), clients 1 and 2 one each. FAULTS faults in
 * all: agent crashes, connections closed, $/cancel_request, session/cancel (or
 * session/close), a batch that fails or whose commit lands with its answer lost, a resend
 * that overlaps an open attempt. Both held-prompt policies (hold, steer); submission 1
 * retained or live-only (chosen at init). One GroupCommit for the store (both sessions).
 * Session 1 is small: its request is never cancelled, no session/cancel targets it, and its
 * turn is not modelled; its write shares batches, batch failures and crashes with session 0.
 *
 * Properties:
 *  P1 at most one user message per (session, key)                       [commit]
 *  P2 every success answer carries the message's id                      [every answer site]
 *  P3 every error answer (-32800, -32603) leaves the key unused          [every answer site];
 *     a prompt answered -32800 is never inserted afterwards, and nothing is inserted for a
 *     client that gave up after error answers                            [commit]
 *  P4 each client that keeps retrying gets the id, of its own submission's message, stored
 *     once                                                               [client end]
 *  L  liveness: every client ends (it got the id, or gave up after error answers): the LTL
 *     property `done`, checked for acceptance cycles under weak fairness. Nothing in the
 *     model can repeat for ever: faults are bounded, and a resend follows an error, a lost
 *     answer (both need a fault) or costs a fault itself, so a hang is a cycle or a
 *     dead end without `done`.
 */

#ifndef FAULTS
#define FAULTS 2
#endif
#define NK 3
#define NR 4                 /* request slots 0, 1: submission 0; 2: submission 1; 3: submission 2 */
#define KEY(r) ((r) == 0 -> 0 : (r) - 1)
#define SESS(k) ((k) / 2)    /* submissions 0 and 1: session 0; submission 2: session 1 */

/* the store's unique (session, key): submission k's key and session */
#ifdef MUTANT_KEY_GLOBAL
#define SK(k) ((k) % 2)      /* the key looked up without its session: "a" of both sessions */
#else
#define SK(k) (k)
#endif

/* request status: what the client sees, and where its handler is */
#define FREE 0
#define SENT 1               /* on the wire, or its handler waits for the session lock */
#define LOOK 2               /* holds the lock: store.find_key in flight */
#define INSW 3               /* holds the lock through its prompt's _insert */
#define WAIT 4               /* waits on its key's pending prompt (lock released) */
#define OK   5               /* answered {messageId: rmid[r]} */
#define CANC 6               /* answered -32800 */
#define FAIL 7               /* answered -32603 */
#define LOST 8               /* its connection closed: the client never hears */

/* pending prompt state per submission (runtime's PendingPrompt, plus the steps of SessionInbox._insert) */
#define NONE 0
#define HELD 1               /* in session.held (hold policy, a turn runs) */
#define INS  2               /* _insert began: its write is in group commit */
#define STORED 3             /* committed, inserted; after_insert, answers, turn next */
#define RECD 4               /* the write found the key recorded: InsertOutcome(inserted=False) */
#define FAILED 5             /* the store raised (its commit may have landed) */
#define HALF 6               /* MUTANT_KEY_APART: the message is stored, its key not yet */

/* the write of submission k in GroupCommit */
#define W_NONE 0
#define W_Q 1                /* queued (withdrawable while queued) */
#define W_T 2                /* taken into the batch being written */

#define HOLD 0
#define STEER 1
#define WORKER 9             /* pown: the session's worker runs the insert (SessionInbox.next -> Placement.next) */

byte rst[NR];                /* request status */
byte rmid[NR];               /* message id of an OK answer */
bool mk[NR];                 /* a session/cancel on its connection arrived after it (D33) */

/* the durable store (survives a crash) */
byte skey[NK];               /* message id recorded with key SK(k); 0: the key is unused */
byte nmsg[NK];               /* ghost: user messages stored for submission k */

/* the agent's memory (lost on a crash) */
byte pst[NK];                /* pending prompt of submission k (session.pending_by_key) */
byte pmid[NK];               /* the message id _insert chose (or the recorded one) */
byte pgen[NK];               /* pending prompts made for k so far: new_id is unique */
byte pown[NK];               /* who runs its insert: request r's handler, or WORKER */
byte ws[NK];                 /* its write in group commit */
bool wd[NK];                 /* ghost: the current pending prompt of k was answered -32800 */
byte live[NK];               /* session.live_keys: key -> message id (live-only) */
byte nlive[NK];              /* ghost: live-only inserts of k in this process */
bool running[2];             /* session.running: a turn runs (or the worker inserts) */
byte lk[2];                  /* session.lock: 0 free, 1 + r a handler's lookup, 10 + k an insert */

bool liveonly[NK];           /* submission k is a locally handled command (never stored) */
bool quit[NK];               /* ghost: client k gave up after error answers */
bool lostk[NK];              /* ghost: an attempt of k lost its connection (no answer) */
byte fin;                    /* clients that ended */
byte policy;
byte faults;

/* faults are bounded: each is guarded by `faults < FAULTS` before anything else */
#define CAN_FAULT (faults < FAULTS)

#define pick_req(P) if :: P(0) -> r = 0 :: P(1) -> r = 1 :: P(2) -> r = 2 :: P(3) -> r = 3 fi
#define pick_key(P) if :: P(0) -> k = 0 :: P(1) -> k = 1 :: P(2) -> k = 2 fi
#define IS_SENT(x) (rst[x] == SENT)
#define CAN_LOCK(x) (rst[x] == SENT && lk[SESS(KEY(x))] == 0)
#define IS_LOOK(x) (rst[x] == LOOK)
#define OPEN(x) (rst[x] >= SENT && rst[x] <= WAIT)
#define OPEN_F(x) (CAN_FAULT && OPEN(x) && (x) != 3)   /* session 1 small: see the header */
#define WAIT_F(x) (CAN_FAULT && rst[x] == WAIT && (x) != 3)
#define P_STORED(x) (pst[x] == STORED)
#define P_RECD(x) (pst[x] == RECD)
#define P_FAILED(x) (pst[x] == FAILED)
#define P_HALF(x) (pst[x] == HALF)
#define P_NEXT(x) (pst[x] == HELD && !running[SESS(x)] && lk[SESS(x)] == 0)
#define ANY_Q (ws[0] == W_Q || ws[1] == W_Q || ws[2] == W_Q)
#define ANY_T (ws[0] == W_T || ws[1] == W_T || ws[2] == W_T)
#define HELD_IN(s) ((s) == 0 -> (pst[0] == HELD || pst[1] == HELD) : pst[2] == HELD)
/* _would_hold: a turn runs (hold policy), or prompts are held already */
#define WOULD_HOLD(s) (policy == HOLD && (running[s] || HELD_IN(s)))
/* the worker is inserting a held prompt of session s */
#define WINS(s) (lk[s] >= 10 && pown[lk[s] - 10] == WORKER)
/* the key is in use: recorded in the store, or (live-only) in session.live_keys */
#define USED(k) (liveonly[k] -> live[k] != 0 : skey[SK(k)] != 0)

#ifdef MUTANT_NO_UNIQUE
#define KEY_UNUSED(k) true                      /* no unique constraint on (session, key) */
#else
#define KEY_UNUSED(k) (skey[SK(k)] == 0)
#endif

/* P2, P3 for an answer just given to request x */
inline check_answer(x) {
  assert(rst[x] != OK || rmid[x] == (liveonly[KEY(x)] -> live[KEY(x)] : skey[SK(KEY(x))]));
  assert((rst[x] != CANC && rst[x] != FAIL) || !USED(KEY(x)))
}

/* _Pending.finish: answer every request waiting on submission k's pending prompt */
inline answer_all(k, st, mid) {
  i = 0;
  do
  :: i < NR ->
     if
     :: KEY(i) == k && (rst[i] == WAIT || rst[i] == INSW) ->
        rst[i] = st; rmid[i] = mid; check_answer(i);
        if :: st == CANC -> wd[k] = true :: else fi
     :: else
     fi;
     i++
  :: else -> break
  od
}

inline new_pending(k) {
  pgen[k]++; pmid[k] = 0; wd[k] = false
}

/* _insert begins (state inserting) under the session lock; `who` runs it. A live-only
   prompt goes to session.live_keys; a retained one's write goes to GroupCommit.submit */
inline begin_insert(k, who) {
  pst[k] = INS; pmid[k] = 1 + k + 3 * pgen[k]; pown[k] = who; lk[SESS(k)] = 10 + k;
  if
  :: liveonly[k] ->
     assert(!wd[k]);
     live[k] = pmid[k]; nlive[k]++; assert(nlive[k] <= 1); pst[k] = STORED
  :: else -> ws[k] = W_Q
  fi
}

/* the batch's transaction writes submission k's message with its key (its own outcome) */
inline commit_one(k) {
  ws[k] = W_NONE;
  if
#ifndef MUTANT_NO_UNIQUE
  :: skey[SK(k)] != 0 -> pmid[k] = skey[SK(k)]; pst[k] = RECD    /* recorded: inserts nothing */
#endif
  :: KEY_UNUSED(k) ->
     nmsg[k]++;
     assert(nmsg[k] <= 1);                      /* P1 */
     assert(!wd[k] && !quit[k]);                /* P3: withdrawn, or given up on */
#ifdef MUTANT_KEY_APART
     pst[k] = HALF                              /* the key follows in a second transaction */
#else
     skey[SK(k)] = pmid[k]; pst[k] = STORED
#endif
  fi
}

proctype agent() {
  byte r, k, s, i;
end:
  do
#if defined(MUTANT_MARK_FIRST) || defined(MUTANT_RETRY_EARLY)
#ifdef MUTANT_MARK_FIRST
#define PRE_LOCK(x) (rst[x] == SENT && mk[x])
#else
#define PRE_LOCK(x) (rst[x] == SENT && !mk[x] && pst[KEY(x)] == INS)
#endif
  /* SessionAgent.prompt before the session lock (the mutants answer there) */
  :: atomic {
       pick_req(PRE_LOCK);
       k = KEY(r);
       if
#ifdef MUTANT_MARK_FIRST
       :: mk[r] -> rst[r] = CANC                  /* the mark checked before the key */
#endif
#ifdef MUTANT_RETRY_EARLY
       :: !mk[r] && pst[k] == INS ->             /* answered with the id before the commit */
          rst[r] = OK; rmid[r] = pmid[k]
#endif
       fi;
       check_answer(r);
       r = 0; k = 0
     }
#endif

  /* SessionAgent.prompt, under the session lock (a request waiting for it is SENT): live_keys,
     pending_by_key, then the lookup or admit */
  :: atomic {
       pick_req(CAN_LOCK);
       k = KEY(r); s = SESS(k);
       if
       :: live[k] != 0 -> rst[r] = OK; rmid[r] = live[k]        /* a live-only key */
       :: live[k] == 0 && pst[k] != NONE ->                      /* join the pending prompt */
          if
          :: mk[r] -> rst[r] = CANC              /* _check_cancel_mark (the key is pending) */
          :: else -> rst[r] = WAIT
          fi
       :: live[k] == 0 && pst[k] == NONE ->
          if
          :: WOULD_HOLD(s) || liveonly[k] || mk[r] ->
             /* store.find_key first (an await): held or live-only, or covered by a
                session/cancel (answered the id of a recorded key, else -32800) */
             rst[r] = LOOK; lk[s] = 1 + r
          :: else ->                             /* coordinator.admit -> _insert at once */
             new_pending(k); rst[r] = INSW; begin_insert(k, r)
          fi
       fi;
       check_answer(r);
       r = 0; k = 0; s = 0
     }

  /* prompt: store.find_key returned (the lock still held) */
  :: atomic {
       pick_req(IS_LOOK);
       k = KEY(r); s = SESS(k);
       lk[s] = 0;
       if
       :: !liveonly[k] && skey[SK(k)] != 0 -> rst[r] = OK; rmid[r] = skey[SK(k)]
       :: else ->
          if
          :: mk[r] -> rst[r] = CANC              /* _check_cancel_mark */
          :: !mk[r] && WOULD_HOLD(s) ->          /* admit(hold=True): session.held */
             new_pending(k); pst[k] = HELD; rst[r] = WAIT
          :: else -> new_pending(k); rst[r] = INSW; begin_insert(k, r)
          fi
       fi;
       check_answer(r);
       r = 0; k = 0; s = 0
     }

  /* GroupCommit: no batch is being written: the writer takes every queued write */
  :: atomic {
       ANY_Q && !ANY_T ->
       k = 0;
       do
       :: k < NK -> if :: ws[k] == W_Q -> ws[k] = W_T :: else fi; k++
       :: else -> break
       od;
       k = 0
     }

  /* GroupCommit: the batch's transaction commits; each write gets its own outcome */
  :: atomic {
       ANY_T ->
       k = 0;
       do
       :: k < NK -> if :: ws[k] == W_T -> commit_one(k) :: else fi; k++
       :: else -> break
       od;
       k = 0
     }

  /* GroupCommit: the batch's transaction fails (nothing written), or its commit lands and
     only the answer is lost (PostgreSQL's connection cut at COMMIT): every write fails */
  :: atomic {
       CAN_FAULT && ANY_T -> faults++;
       if
       :: k = 0;
          do
          :: k < NK -> if :: ws[k] == W_T -> ws[k] = W_NONE; pst[k] = FAILED :: else fi; k++
          :: else -> break
          od
       :: k = 0;
          do
          :: k < NK ->
             if
             :: ws[k] == W_T ->
                commit_one(k);
                if :: pst[k] == HALF -> skey[SK(k)] = pmid[k] :: else fi;
                pst[k] = FAILED
             :: else
             fi;
             k++
          :: else -> break
          od
       fi;
       k = 0
     }

#ifdef MUTANT_KEY_APART
  :: atomic { pick_key(P_HALF); skey[SK(k)] = pmid[k]; pst[k] = STORED; k = 0 }
#endif

  /* _insert after a committed insert: after_insert, pending.finish, the turn queued; the
     lock is released (a cancellation in these awaits changes nothing: try/finally) */
  :: atomic {
       pick_key(P_STORED);
       s = SESS(k);
       answer_all(k, OK, pmid[k]); pst[k] = NONE; lk[s] = 0;
       running[s] = (s == 0);                   /* the turn queued (session 1's: not modelled) */
       k = 0; s = 0
     }

  /* _insert: the key was recorded already: answered as a retry, no turn */
  :: atomic {
       pick_key(P_RECD);
       s = SESS(k);
       answer_all(k, OK, pmid[k]); pst[k] = NONE; lk[s] = 0;
       k = 0; s = 0
     }

  /* _insert's except branch: _find_after_failure looks the key up (shielded) */
  :: atomic {
       pick_key(P_FAILED);
       s = SESS(k);
       if
#ifndef MUTANT_NO_LOOKUP
       :: skey[SK(k)] != 0 -> pmid[k] = skey[SK(k)]; pst[k] = STORED    /* landed after all */
#endif
       :: else -> answer_all(k, FAIL, 0); pst[k] = NONE; lk[s] = 0      /* the key stays unused */
       fi;
       k = 0; s = 0
     }

  /* _worker: the turn ends (run_turn returned) */
  :: atomic { running[0] && !WINS(0) -> running[0] = false }

  /* TurnRunner._work -> SessionInbox.next (under the lock): no turn left, insert the next held prompt */
  :: atomic {
       pick_key(P_NEXT);
       s = SESS(k);
       running[s] = true;                       /* session.running stays set while it inserts */
       begin_insert(k, WORKER);
       k = 0; s = 0
     }

  /* SessionInbox.withdraw: $/cancel_request for a waiting request (a fault the client chooses) */
  :: atomic {
       pick_req(WAIT_F); faults++;
       k = KEY(r);
       if
       :: pst[k] == HELD ->                     /* withdraw: every waiter gets -32800 */
#ifdef MUTANT_WITHDRAW_ONE
          rst[r] = CANC; check_answer(r); wd[k] = true   /* only the cancelled request */
#else
          answer_all(k, CANC, 0); pst[k] = NONE
#endif
#ifdef MUTANT_WITHDRAW_INSERTING
       :: pst[k] == INS ->                      /* withdrawn although the insert is in flight */
          answer_all(k, CANC, 0)
#endif
       :: else -> skip                          /* R27: once inserting, insertion wins */
       fi;
       r = 0; k = 0
     }

  /* the connection of a request closes: its handler is cancelled at its current await */
  :: atomic {
       pick_req(OPEN_F); faults++;
       k = KEY(r); s = SESS(k);
       lostk[k] = true;
       if
       :: rst[r] == LOOK -> lk[s] = 0           /* the lookup cancelled: nothing registered */
       :: rst[r] == INSW && ws[k] == W_Q ->
          /* GroupCommit withdraws the queued write (nothing written); _insert's cancellation
             branch unregisters the pending prompt and ends it -32800, key unused (its only
             waiter is this request: joining takes the lock the insert holds) */
          ws[k] = W_NONE; lk[s] = 0;
#ifdef MUTANT_CANCEL_INSERT
          skip                                  /* the old _insert: left registered, inserting */
#else
          pst[k] = NONE
#endif
       :: else       /* SENT: nothing yet; INSW with its write in a batch: the batch's outcome
                        comes first (GroupCommit), and after a commit _insert's try/finally
                        answers and queues the turn */
       fi;
       rst[r] = LOST;
       /* D11: a held prompt nobody waits for any more is withdrawn (nobody to answer) */
       if
       :: pst[k] == HELD && (k != 0 || (rst[0] != WAIT && rst[1] != WAIT)) -> pst[k] = NONE
       :: else
       fi;
       r = 0; k = 0; s = 0
     }

  /* session/cancel or session/close on the connection of request r (or on another one):
     marks r (D33), withdraws the held prompts (-32800), unregisters inserting ones (the lock
     keeps them out of reach anyway), clears the queued turns, cancels the running turn */
  :: atomic {
       CAN_FAULT -> faults++;
       s = 0;                                   /* session 1 small: see the header */
       if
       :: r = 0 :: r = 1 :: r = 2 :: r = NR
       fi;
       if
       :: r < NR && SESS(KEY(r)) == s && rst[r] >= SENT && rst[r] <= LOOK -> mk[r] = true
       :: else
       fi;
       k = 0;
       do
       :: k < NK ->
          if :: SESS(k) == s && pst[k] == HELD -> answer_all(k, CANC, 0); pst[k] = NONE :: else fi;
          k++
       :: else -> break
       od;
       if :: !WINS(s) -> running[s] = false :: else fi;
       r = 0; k = 0; s = 0
     }

  /* SIGKILL: the process dies at this step and is restarted on the same store */
  :: atomic {
       CAN_FAULT -> faults++;
       r = 0;
       do
       :: r < NR -> if :: OPEN(r) -> rst[r] = LOST; lostk[KEY(r)] = true :: else fi; mk[r] = false; r++
       :: else -> break
       od;
       k = 0;
       do
       :: k < NK -> pst[k] = NONE; ws[k] = W_NONE; live[k] = 0; nlive[k] = 0; k++
       :: else -> break
       od;
       running[0] = false; running[1] = false; lk[0] = 0; lk[1] = 0;
       r = 0; k = 0
     }
  od
}

/* A client (acp_once.client.AcpClient): one submission, one key, resent until answered.
   A resend follows an error or a lost answer; one that overlaps an open attempt costs a
   fault. After error answers only (none lost), it may give up. */
#define RESENDABLE(x) (rst[x] == FREE || rst[x] >= CANC)
#define ERRED(x) (rst[x] == CANC || rst[x] == FAIL)
proctype client(byte k) {
  byte got;
  byte a = (k == 0 -> 0 : k + 1);
  byte b = (k == 0 -> 1 : a);                  /* clients 1 and 2 have one request slot */
  do
  :: atomic { rst[a] == OK -> got = rmid[a]; break }
  :: atomic { rst[b] == OK -> got = rmid[b]; break }
  :: atomic { RESENDABLE(a) && !OPEN(b) && rst[b] != OK -> rst[a] = SENT; mk[a] = false }
  :: atomic { a != b && rst[a] != FREE && RESENDABLE(b) && !OPEN(a) && rst[a] != OK ->
       rst[b] = SENT; mk[b] = false }
  /* a resend on a new connection while the other attempt is still open */
  :: atomic { CAN_FAULT && a != b && RESENDABLE(a) && OPEN(b) -> faults++; rst[a] = SENT; mk[a] = false }
  :: atomic { CAN_FAULT && a != b && RESENDABLE(b) && OPEN(a) -> faults++; rst[b] = SENT; mk[b] = false }
  /* gives up: every attempt was answered with an error */
  :: atomic { !lostk[k] && ERRED(a) && (ERRED(b) || rst[b] == FREE) -> quit[k] = true; fin++; goto gone }
  od;
  /* P4: the id it got is its own submission's message, inserted once */
  assert(got != 0);
  assert(liveonly[k] || (got == skey[SK(k)] && nmsg[k] == 1));
  fin++;
gone:
  skip
}

ltl done { <> (fin == 3) }

init {
  atomic {
    if :: policy = HOLD :: policy = STEER fi;
    if :: liveonly[1] = false :: liveonly[1] = true fi;
    rst[0] = SENT; rst[2] = SENT; rst[3] = SENT;   /* the first attempts (handled any time) */
    run agent();
    run client(0);
    run client(1);
    run client(2)
  }
}
