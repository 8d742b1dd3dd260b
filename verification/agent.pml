/*
 * agent.pml: one SessionAgent, one session, clients that retry with the same key.
 *
 * What each action stands for in src/ is named in its comment. The agent is one process
 * (one event loop: each `atomic` is the code between two awaits); every step an `await`
 * separates in the code is a separate step here, so the crash (SIGKILL) and the faults can
 * fall between any two of them.
 *
 * Bounds: NK=2 submissions (client k sends key k), 2 request slots per client (a retry on a
 * new connection may overlap an attempt the client gave up on), FAULTS faults in all
 * (agent crashes, connections closed, $/cancel_request, store failures), both held-prompt
 * policies (hold, steer), and each submission either retained or live-only (chosen at init).
 *
 * Properties (assertions; a blocked client at the end is an invalid end state):
 *  P1 at most one user message per (session, key)                  [commit]
 *  P2 every success answer carries the message's id                [answer]
 *  P3 a withdrawn (-32800) or refused (-32603) attempt leaves the key unused; a withdrawn
 *     prompt is never inserted afterwards                          [answer, commit]
 *  P4 once the faults are spent, a client that keeps retrying gets the id, and its
 *     submission is inserted exactly once                          [client end]
 */

#ifndef FAULTS
#define FAULTS 3
#endif
#define NK 2
#define NR 4                 /* request slots: r / 2 is the key (the client) it belongs to */
#define KEY(r) ((r) / 2)

/* request status: what the client sees */
#define FREE 0
#define SENT 1               /* on the wire, not handled yet */
#define WAIT 2               /* handled, waiting on its key's pending prompt */
#define OK   3               /* answered {messageId: rmid[r]} */
#define CANC 4               /* answered -32800 */
#define FAIL 5               /* answered -32603 */
#define LOST 6               /* its connection closed: the client never hears */

/* pending prompt state per key (runtime._Pending.state, plus the steps of _insert) */
#define NONE 0
#define HELD 1               /* in session.held (hold policy, a turn runs) */
#define INS  2               /* _insert began: the store call is in flight */
#define STORED 3             /* committed; after_insert/answer not done yet */
#define FAILED 4             /* the store raised (its commit may have landed) */
#define HALF 5               /* MUTANT_KEY_APART: the message is stored, its key not yet */

#define HOLD 0
#define STEER 1

byte rst[NR];                /* request status */
byte rmid[NR];               /* message id of an OK answer */
byte rgen[NR];               /* generation of the pending prompt the request waits on */

/* the durable store (survives a crash): insert_user_message's transaction */
byte skey[NK];               /* message id recorded with key k; 0: the key is unused */
byte nmsg[NK];               /* ghost: user messages stored for submission k */

/* the agent's memory (lost on a crash) */
byte pst[NK];                /* pending prompt for key k (session.pending_by_key) */
byte pmid[NK];               /* the message id _insert chose (new_id: unique per key here) */
byte pgen[NK];               /* ghost: pending prompts made for key k so far */
bool wd[NK];                 /* ghost: the current pending prompt of k was withdrawn */
byte live[NK];               /* session.live_keys: key -> message id (live-only) */
byte nlive[NK];              /* ghost: live-only inserts of k in this process */
bool running;                /* session.running: a turn runs */

bool liveonly[NK];           /* submission k is a locally handled command (never stored) */
byte policy;
byte faults;


/* pick a request (a key) in a given state, any of them; blocks as a whole when there is none */
#define pick_req(P) if :: P(0) -> r = 0 :: P(1) -> r = 1 :: P(2) -> r = 2 :: P(3) -> r = 3 fi
#define pick_key(P) if :: P(0) -> k = 0 :: P(1) -> k = 1 fi
#define IS_SENT(x) (rst[x] == SENT)
#define WAIT_F(x) (CAN_FAULT && rst[x] == WAIT)
#define OPEN_F(x) (CAN_FAULT && (rst[x] == WAIT || rst[x] == SENT))
#define P_INS(x) (pst[x] == INS)
#define P_FAILED(x) (pst[x] == FAILED)
#define P_STORED(x) (pst[x] == STORED)
#define P_HALF(x) (pst[x] == HALF)

#ifdef MUTANT_NO_UNIQUE
#define KEY_UNUSED(k) true                      /* no unique constraint on (session, key) */
#else
#define KEY_UNUSED(k) (skey[k] == 0)
#endif
#ifdef MUTANT_RETRY_EARLY
#define JOINS(k) (pst[k] != INS)
#else
#define JOINS(k) true
#endif

/* faults are bounded: each is guarded by `faults < FAULTS` before anything else */
#define CAN_FAULT (faults < FAULTS)

/* finish: answer every request waiting on key k's pending prompt (_Pending.finish) */
inline answer_all(k, st, mid) {
  i = 0;
  do
  :: i < NR ->
     if
     :: KEY(i) == k && rst[i] == WAIT ->
        assert(rgen[i] == pgen[k]);
        rst[i] = st; rmid[i] = mid; rgen[i] = 0;
        /* P2, P3 for every answered waiter */
        assert(st != OK || mid == (liveonly[k] -> live[k] : skey[k]));
        assert(st != FAIL || skey[k] == 0)
     :: else
     fi;
     i++
  :: else -> break
  od
}

inline check_answer(r) {
  /* P2: a success answer carries the id the store (or the live map) has for the key */
  assert(rst[r] != OK || rmid[r] == (liveonly[KEY(r)] -> live[KEY(r)] : skey[KEY(r)]));
  /* P3: an error answer means nothing was recorded for the key */
  assert(rst[r] != FAIL || skey[KEY(r)] == 0);
  assert(rst[r] != CANC || skey[KEY(r)] == 0 || liveonly[KEY(r)])
}

inline new_pending(k) {
  pgen[k]++; pst[k] = NONE; wd[k] = false
}

proctype agent() {
  byte r, k, i;
end:
  do
  /* SessionAgent.prompt: a request arrives (under the session lock) */
  :: atomic {
       pick_req(IS_SENT);
       k = KEY(r);
       if
       :: live[k] != 0 ->                       /* recorded = session.live_keys.get(key) */
          rst[r] = OK; rmid[r] = live[k]
#ifdef MUTANT_RETRY_EARLY
       :: live[k] == 0 && pst[k] == INS ->     /* answered with the id before the commit */
          rst[r] = OK; rmid[r] = pmid[k]
#endif
       :: live[k] == 0 && pst[k] != NONE && JOINS(k) ->                                    /* pending_by_key: join it (one pending) */
          rst[r] = WAIT; rgen[r] = pgen[k]
       :: live[k] == 0 && pst[k] == NONE ->
          if
          :: (policy == HOLD && (running || pst[1-k] == HELD)) || liveonly[k] ->
             /* _would_hold or live-only: store.find_key first */
             if
             :: skey[k] != 0 -> rst[r] = OK; rmid[r] = skey[k]
             :: else ->
                new_pending(k); rst[r] = WAIT; rgen[r] = pgen[k];
                if
                :: policy == HOLD && (running || pst[1-k] == HELD) -> pst[k] = HELD
                :: else -> pst[k] = INS; pmid[k] = pgen[k]     /* _insert */
                fi
             fi
          :: else ->                            /* inserted at once: _insert */
             new_pending(k); rst[r] = WAIT; rgen[r] = pgen[k];
             pst[k] = INS; pmid[k] = pgen[k]
          fi
       fi;
       check_answer(r);
       r = 0; k = 0
     }

  /* _insert: store.insert_user_message, one transaction (key and message together) */
  :: atomic {
       pick_key(P_INS);
       assert(!wd[k]);      /* P3: a withdrawn prompt is never inserted */
       if
       :: liveonly[k] ->                        /* live-only: session.live_keys, no store */
          live[k] = pmid[k]; nlive[k]++; assert(nlive[k] <= 1); pst[k] = STORED
#ifndef MUTANT_NO_UNIQUE
       :: !liveonly[k] && skey[k] != 0 ->      /* the key is recorded: InsertOutcome(inserted=False) */
          pmid[k] = skey[k];
          answer_all(k, OK, pmid[k]); pst[k] = NONE
#endif
       :: !liveonly[k] && KEY_UNUSED(k) ->     /* the unique (session, key) check passes */
          nmsg[k]++;
          assert(nmsg[k] <= 1);                 /* P1 */
#ifdef MUTANT_KEY_APART
          pst[k] = HALF                         /* the key follows in a second transaction */
#else
          skey[k] = pmid[k]; pst[k] = STORED
#endif
       :: !liveonly[k] && skey[k] == 0 && CAN_FAULT -> faults++;
          /* the store raised: nothing stored, or the commit landed and only its answer
             was lost (PostgreSQL's connection cut at COMMIT) */
          if
          :: pst[k] = FAILED
          :: nmsg[k]++; assert(nmsg[k] <= 1); skey[k] = pmid[k]; pst[k] = FAILED
          fi
       fi;
       k = 0
     }

#ifdef MUTANT_KEY_APART
  :: atomic { pick_key(P_HALF); skey[k] = pmid[k]; pst[k] = STORED; k = 0 }
#endif

  /* _insert's except branch: _find_after_failure looks the key up */
  :: atomic {
       pick_key(P_FAILED);
       if
#ifndef MUTANT_NO_LOOKUP
       :: skey[k] != 0 -> pmid[k] = skey[k]; pst[k] = STORED     /* landed after all */
#endif
       :: else -> answer_all(k, FAIL, 0); pst[k] = NONE           /* the key stays unused */
       fi;
       k = 0
     }

  /* _insert after the commit: after_insert, pending.finish, the turn is queued */
  :: atomic {
       pick_key(P_STORED);
       answer_all(k, OK, pmid[k]); pst[k] = NONE; running = true;
       k = 0
     }

  /* _worker: the turn ends (run_turn returned) */
  :: running -> running = false

  /* _worker: no turn left, insert the next held prompt (hold policy) */
  :: atomic {
       !running && (pst[0] == HELD || pst[1] == HELD) ->
       if
       :: pst[0] == HELD -> k = 0
       :: pst[1] == HELD -> k = 1
       fi;
       running = true;                          /* session.running stays set while it inserts */
       pst[k] = INS; pmid[k] = pgen[k]; k = 0
     }

  /* _on_cancel_request: $/cancel_request for a waiting request (a fault the client chooses) */
  :: atomic {
       pick_req(WAIT_F); faults++;
       k = KEY(r);
       if
       :: pst[k] == HELD ->                     /* _withdraw: every waiter gets -32800 */
          wd[k] = true;
#ifdef MUTANT_WITHDRAW_ONE
          rst[r] = CANC                         /* only the cancelled request */
#else
          answer_all(k, CANC, 0); pst[k] = NONE
#endif
#ifdef MUTANT_WITHDRAW_INSERTING
       :: pst[k] == INS ->                      /* withdrawn although the insert is in flight */
          wd[k] = true;
          answer_all(k, CANC, 0)
#endif
       :: else -> skip                          /* R27: once inserting, insertion wins */
       fi;
       check_answer(r);
       r = 0; k = 0
     }

  /* connection_closed: a request's connection closes (answer lost), or it never arrived */
  :: atomic {
       pick_req(OPEN_F); faults++;
       k = KEY(r);
       rst[r] = LOST; rgen[r] = 0;
       /* D11: a held prompt nobody waits for any more is withdrawn (nobody to answer) */
       if
       :: pst[k] == HELD && rst[2*k] != WAIT && rst[2*k+1] != WAIT ->
          wd[k] = true; pst[k] = NONE
       :: else
       fi;
       r = 0; k = 0
     }

  /* SIGKILL: the process dies at this step and is restarted on the same store */
  :: atomic {
       CAN_FAULT -> faults++;
       r = 0;
       do
       :: r < NR -> if :: rst[r] == WAIT || rst[r] == SENT -> rst[r] = LOST; rgen[r] = 0 :: else fi; r++
       :: else -> break
       od;
       k = 0;
       do
       :: k < NK ->
          if
          :: pst[k] == INS || pst[k] == HELD -> wd[k] = true
          :: else
          fi;
          pst[k] = NONE; live[k] = 0; nlive[k] = 0; k++
       :: else -> break
       od;
       running = false; r = 0; k = 0
     }
  od
}

/* A client (acp_once.client.AcpClient): one submission, one key, resent until answered */
proctype client(byte k) {
  byte got;
  byte r = 2 * k;
  do
  :: atomic { rst[r] == OK -> got = rmid[r]; break }
  :: atomic { rst[r + 1] == OK -> got = rmid[r + 1]; break }
  /* a resend on a new connection (after resume), with the same key */
  :: atomic { (rst[r] == FREE || rst[r] >= CANC) && rst[r + 1] != OK -> rst[r] = SENT }
  :: atomic { (rst[r + 1] == FREE || rst[r + 1] >= CANC) && rst[r] != OK -> rst[r + 1] = SENT }
  od;
  /* P4: the id it got is the message's, inserted once (a live-only one: in this process) */
  assert(got != 0);
  assert(liveonly[k] || (got == skey[k] && nmsg[k] == 1))
}

init {
  atomic {
    if :: policy = HOLD :: policy = STEER fi;
    if :: liveonly[1] = false :: liveonly[1] = true fi;
    run agent();
    run client(0);
    run client(1)
  }
}
