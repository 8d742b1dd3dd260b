/*
 * cluster.pml: two SessionAgent nodes on one PostgreSQL database, one session, one client
 * submission (one key) that the client resends to either node.
 *
 * Each `atomic` is one transaction or the code between two awaits; the comment names the
 * function in src/ (acp_once.cluster: the coordinator and its SQL; acp_once.storage.postgres:
 * the fenced insert; acp_once.agent.inbox: submit, _insert). A node is one process: its
 * steps interleave with the other node's. A node's requests for the session take its session
 * lock for their admission and insert (`lk`), as does its worker for a queued prompt.
 *
 * Bounds: 2 nodes, 1 key, 2 request slots (a resend may overlap an open attempt: that costs
 * a fault), 2 queue rows (each with its own state; a new row is queued only while none is
 * queued: the unique (session, key) index), FAULTS faults in all: a node killed (restarted
 * as a new instance), a node stalled past the lease TTL (its lease and its heartbeat expire;
 * it resumes at its next renewal), a lost NOTIFY (of an outcome, or the wake-up of an idle
 * owner), a connection closed (at any await of the admission), a $/cancel_request, a
 * session/cancel, a failed insert of a queued row, a resend overlapping an open attempt. Both policies (hold: the owner queues behind its
 * turn; steer: the owner inserts at once and inserts queued rows mid-turn). At start the
 * session is idle, or node 0 owns it with a turn running.
 *
 * Sticky leases: the owner keeps the lease while its worker runs (`work`) and, once the
 * worker has nothing left, for a grace period (idle: the lease held, no worker; time is
 * abstract, so the grace ends at any step). A prompt on the owner for a session whose lease
 * it holds is inserted at once, with no lease statement (the fenced insert). The background
 * renewal renews every lease the node holds, active or idle, and drops one it finds lost. A
 * prompt queued behind a live owner on another node wakes it (a NOTIFY, which may be lost);
 * an idle owner starts its worker on that NOTIFY, on its poll (the safety net) or when its
 * release after the grace is refused because rows are queued. An owner that stalls stops
 * renewing: its lease expires and a waiting node takes it over (a new epoch); the stale
 * owner's fenced writes fail, and its next renewal reports the lease lost.
 *
 * Properties:
 *  C1 at most one user message for the key                              [every write]
 *  C2 every success answer carries the message's id                     [every answer site]
 *  C3 every error answer (-32800, -32603) leaves the key unused          [every answer site];
 *     nothing is inserted for a client that gave up after error answers [every write]
 *  C4 fenced writes of a stale owner never land: no write lands on a node whose lease
 *     expired and was taken by another node since it took it            [every write]
 *  C5 no turn starts on one node while another runs one, unless that one's lease expired
 *     and was taken over (its writes are refused: C4)                    [turn start]
 *  C6 a client that keeps retrying gets the id, inserted exactly once   [client end]
 *  C7 a queued prompt never waits behind a free lease: the owner it was queued behind
 *     inserts it, or (dead or stalled) its lease expires and a waiter takes it over; a
 *     lease is released only with nothing queued (one arrival order)     [takeover]
 *  L  liveness: the client ends (it got the id, or gave up after error answers): the LTL
 *     property `done` under weak fairness. Renewal, polling and NOTIFY delivery are steps
 *     only when they change something, faults are bounded and a resend follows an error or
 *     a lost answer (each needs a fault) or costs a fault itself: a hang is a dead end or a
 *     cycle without `done`.
 */

#ifndef FAULTS
#define FAULTS 2
#endif
#define CAN_FAULT (faults < FAULTS)

/* request status */
#define FREE 0
#define SENT 1      /* on the wire, or waiting for its node's session lock */
#define ADMIT 2     /* registered by key, under the lock: PgCluster.admit in flight */
#define DIRECT 3    /* under the lock: this node holds the lease, agent._insert next */
#define FLOOK 4     /* under the lock: the fenced insert was refused, _find_after_failure */
#define WROW 5      /* waiting on its queued row rrow (NOTIFY or the poll) */
#define OK 6
#define CANC 7
#define FAIL 8
#define LOST 9

/* queued row (prompt_queue.state) */
#define NOROW 0
#define QUEUED 1
#define INSERTED 2  /* inserted, or `recorded` (the key was inserted already): message id */
#define WITHDRAWN 3
#define ABANDONED 4 /* its origin instance is dead: submitted again by its waiters */
#define DROPPED 5   /* no node waits on it any more */
#define RFAILED 6   /* the owner could not store it (PgCluster.fail) */
#define NOR 2       /* rrow of a request that waits on no row */

#define HOLD 0
#define STEER 1

byte rst[2]; byte rnode[2]; byte rmid[2]; byte rrow[2];

/* the database */
byte lown;          /* session_leases.owner: an instance id (1 + node + 2 * incarnation), 0 free */
byte lep;           /* session_leases.epoch: the fencing token */
bool lexp;          /* expires_at < now() */
byte qs[3];         /* prompt_queue.state of rows 0 and 1 (qs[NOR] stays NOROW) */
byte qorig[2];      /* the instance that queued the row */
byte qkey[2];       /* ghost: the key's message id when the row's outcome was settled */
byte skey;          /* message id recorded with the key; 0 unused */
byte nmsg;          /* ghost: user messages stored for the key */
bool note[2];       /* a NOTIFY of a row's outcome on its way to node n */

/* the nodes' memory */
byte inc[2];        /* incarnation: a killed node comes back as a new instance */
byte myep[2];       /* coordinator.leases[session]: the epoch it believes it holds, 0 none */
bool turn[2];       /* a turn runs there */
bool work[2];       /* its worker for the session runs (the turn, then the queue); with
                       myep != 0 and no worker the lease is kept idle, in its grace */
bool wake[2];       /* a NOTIFY (a prompt queued behind this owner) on its way to node n */
bool stall[2];      /* stalled past the TTL: its lease and heartbeat expire; only its write in
                       flight may still land; it resumes at its next renewal */
byte lk[2];         /* its session lock: 0 free, 1 + r the admission of request r */
bool stuck[2];      /* MUTANT_CANCEL_ADMIT: a pending prompt left registered, never answered */
bool over[2];       /* ghost: another node took the lease, expired, since this one took it */
bool quit;          /* ghost: the client gave up after error answers */
bool lostc;         /* ghost: an attempt lost its connection (no answer) */
bool cdone;         /* the client ended */
byte policy;
byte faults;
byte mids;          /* message ids handed out (new_id) */

#define ME(n) (1 + (n) + 2 * inc[n])
#define NODE(i) (((i) - 1) % 2)
#define ALIVE(i) ((i) == ME(NODE(i)) && !stall[NODE(i)])   /* a recent heartbeat */
#define HOLDS(n) (lown == ME(n) && lep == myep[n])
#ifdef MUTANT_NO_FENCE
#define FENCE_OK(n) true                 /* the write does not check the fence */
#else
#define FENCE_OK(n) HOLDS(n)
#endif
#ifdef MUTANT_KEPT_UNFENCED
/* the insert on a lease the node keeps idle (no worker) trusts the node's own lease map */
#define DIRECT_OK(n) ((myep[n] != 0 && !work[n]) || FENCE_OK(n))
#else
#define DIRECT_OK(n) FENCE_OK(n)
#endif
#ifdef MUTANT_TAKE_UNEXPIRED
#define TAKEABLE true                    /* taken whether or not it expired */
#else
#define TAKEABLE (lown == 0 || lexp)
#endif
#ifdef MUTANT_ROW_UNGUARDED
#define ROW_OK(q) (qs[q] == QUEUED || qs[q] == WITHDRAWN)  /* read before it was withdrawn */
#else
#define ROW_OK(q) (qs[q] == QUEUED)
#endif
#define QROW (qs[0] == QUEUED -> 0 : (qs[1] == QUEUED -> 1 : NOR))   /* the queued row */
#define ANYQ (qs[0] == QUEUED || qs[1] == QUEUED)
#define MINE(r, n) (rst[r] != FREE && rnode[r] == n)
#define OPEN(r) (rst[r] >= SENT && rst[r] <= WROW)
#define DONE_ROW(q) (qs[q] >= INSERTED && qs[q] != NOROW)
#ifdef MUTANT_NO_ANSWER
#define ANSWERABLE(q) (DONE_ROW(q) && qs[q] != INSERTED)   /* inserted rows never answered */
#else
#define ANSWERABLE(q) DONE_ROW(q)
#endif
/* node n has a request waiting on a row with an outcome */
#define TO_ANSWER(n) ((rst[0] == WROW && rnode[0] == n && ANSWERABLE(rrow[0])) || \
                      (rst[1] == WROW && rnode[1] == n && ANSWERABLE(rrow[1])))

/* C2, C3 for an answer just given to request x (for a row's outcome: the key as it was
   when the outcome was settled; the answer may arrive later, by NOTIFY or the poll) */
inline check_answer(x) {
  assert(rst[x] != OK || (rmid[x] == skey && skey != 0));
  assert((rst[x] != CANC && rst[x] != FAIL) || skey == 0)
}
inline check_row_answer(x) {
  assert(rst[x] != OK || (rmid[x] == skey && skey != 0));
  assert((rst[x] != CANC && rst[x] != FAIL) || qkey[rrow[x]] == 0)
}

/* a row's outcome is settled (and notified): its state, and the key's as it is now */
inline settle(q, st) {
  qs[q] = st; qkey[q] = skey; note[0] = true; note[1] = true
}

/* taking a lease bumps the epoch; only equality with what nodes believe matters, so the
   model picks the smallest value no node holds (keeps the state space finite) */
inline new_epoch() {
  if
  :: myep[0] != 1 && myep[1] != 1 && lep != 1 -> lep = 1
  :: else ->
     if
     :: myep[0] != 2 && myep[1] != 2 && lep != 2 -> lep = 2
     :: else ->
        if
        :: myep[0] != 3 && myep[1] != 3 && lep != 3 -> lep = 3
        :: else -> lep = 4
        fi
     fi
  fi
}

/* PgCluster._take: epoch + 1, the queued rows of dead origins abandoned (notified) */
inline take(n) {
  if :: lown != 0 && !lexp -> skip :: else -> over[1 - n] = true fi;   /* expired (or free) */
  new_epoch(); lown = ME(n); lexp = false; myep[n] = lep; over[n] = false; work[n] = true;
  if :: qs[0] == QUEUED && !ALIVE(qorig[0]) -> settle(0, ABANDONED) :: else fi;
  if :: qs[1] == QUEUED && !ALIVE(qorig[1]) -> settle(1, ABANDONED) :: else fi
}

inline start_turn(n) {
  assert(!turn[1 - n] || over[1 - n]);     /* C5 */
  turn[n] = true; work[n] = true
}

/* the fenced insert's transaction lands: the message with its key, or the key is recorded */
inline write(n) {
  assert(!over[n]);                        /* C4: a stale owner's write never lands */
  if
  :: skey == 0 ->
     mids++; skey = mids; nmsg++;
     assert(nmsg <= 1);                    /* C1 */
     assert(!quit);                        /* C3: given up on after error answers */
     start_turn(n)
  :: else      /* the key is recorded: InsertOutcome(inserted=False), no turn */
  fi
}

/* a new queued row: one no request waits on (the other request may wait on one); the
   statement NOTIFYs a live owner on another node (PgCluster.admit: the wake-up) */
inline queue_row(n, r) {
  if
  :: rst[1 - r] == WROW && rrow[1 - r] == 0 -> rrow[r] = 1
  :: else -> rrow[r] = 0
  fi;
  qs[rrow[r]] = QUEUED; qorig[rrow[r]] = ME(n);
  if :: lown == ME(1 - n) -> wake[1 - n] = true :: else fi
}

/* _lost: the node stops treating the session as owned (its turn can no longer write) */
inline lost(n) {
  myep[n] = 0; turn[n] = false; work[n] = false
}

/* _outcome: node n answers its requests waiting on a row with an outcome */
inline answer_rows(n) {
  i = 0;
  do
  :: i < 2 ->
     if
     :: rst[i] == WROW && rnode[i] == n && ANSWERABLE(rrow[i]) ->
        if
        :: qs[rrow[i]] == INSERTED -> rst[i] = OK; rmid[i] = skey
        :: qs[rrow[i]] == WITHDRAWN -> rst[i] = CANC
        :: qs[rrow[i]] == RFAILED -> rst[i] = FAIL
        :: qs[rrow[i]] == ABANDONED || qs[rrow[i]] == DROPPED ->
           rst[i] = SENT; rrow[i] = NOR          /* _readmit: submitted again */
        fi;
        check_row_answer(i)
     :: else
     fi;
     i++
  :: else -> break
  od
}

/* PgCluster.withdraw of queued row q (under the lease row's lock, after the insert in
   flight): `recorded` when its key is inserted, `withdrawn` only while it is unused */
inline withdraw_row(q) {
  if
#ifndef MUTANT_WITHDRAW_RECORDED
  :: qs[q] == QUEUED && skey != 0 -> settle(q, INSERTED)
  :: qs[q] == QUEUED && skey == 0 ->
#else
  :: qs[q] == QUEUED ->                    /* the guard removed: `state = 'queued'` alone */
#endif
     settle(q, WITHDRAWN)
  :: else                                  /* not queued: inserted first (R27) */
  fi
}

proctype node(byte n) {
  byte r, i, q;
end:
  do
  /* SessionAgent.prompt under the node's session lock: pending_by_key, then admit: the
     owner inserts (or queues behind its turn: _enqueue_owned); a non-owner looks the key up
     (find_key) */
  :: atomic { !stall[n] && lk[n] == 0 && ((rst[0] == SENT && rnode[0] == n) || (rst[1] == SENT && rnode[1] == n)) ->
       if :: rst[0] == SENT && rnode[0] == n -> r = 0 :: rst[1] == SENT && rnode[1] == n -> r = 1 fi;
       if
       :: stuck[n] -> rst[r] = WROW; rrow[r] = NOR              /* joins the dead pending */
       :: !stuck[n] && rst[1 - r] == WROW && rnode[1 - r] == n && qs[rrow[1 - r]] == QUEUED ->
          rst[r] = WROW; rrow[r] = rrow[1 - r]                   /* joins the pending here */
       :: else ->
          if
          :: myep[n] != 0 && (!turn[n] || policy == STEER) -> rst[r] = DIRECT; lk[n] = 1 + r
          :: myep[n] != 0 && (!turn[n] || policy == STEER) && ANYQ && HOLDS(n) ->
             /* rows are queued: behind them (one arrival order), attached to the row with its
                key; the branch above, the insert at once, stays too (a superset: the model's
                one key cannot tell the two orders apart) */
             rrow[r] = QROW; rst[r] = WROW
          :: myep[n] != 0 && turn[n] && policy == HOLD && HOLDS(n) ->
             if                                                  /* attach, or queue */
             :: ANYQ -> rrow[r] = QROW
             :: else -> queue_row(n, r)
             fi;
             rst[r] = WROW
          :: myep[n] != 0 && turn[n] && policy == HOLD && !HOLDS(n) ->
             lost(n);                                            /* _lost; decide again */
             if :: skey != 0 -> rst[r] = OK; rmid[r] = skey :: else -> rst[r] = ADMIT; lk[n] = 1 + r fi
          :: myep[n] == 0 && skey != 0 -> rst[r] = OK; rmid[r] = skey   /* recorded: any node */
          :: myep[n] == 0 && skey == 0 -> rst[r] = ADMIT; lk[n] = 1 + r
          fi
       fi;
       check_answer(r); r = 0 }

  /* PgCluster.admit (epoch None): lock the lease; attach to the queued row with the key,
     else take the lease if free or expired, else queue behind the live owner */
  :: atomic { !stall[n] && ((rst[0] == ADMIT && rnode[0] == n) || (rst[1] == ADMIT && rnode[1] == n)) ->
       if :: rst[0] == ADMIT && rnode[0] == n -> r = 0 :: rst[1] == ADMIT && rnode[1] == n -> r = 1 fi;
       if
       :: ANYQ -> rrow[r] = QROW; rst[r] = WROW; lk[n] = 0
       :: !ANYQ && TAKEABLE -> take(n); rst[r] = DIRECT
       :: else -> queue_row(n, r); rst[r] = WROW; lk[n] = 0
       fi; r = 0 }

  /* agent._insert through the fenced insert (a connection closed before it commits: see the
     faults; after: only the answer is lost) */
  :: atomic { (rst[0] == DIRECT && rnode[0] == n) || (rst[1] == DIRECT && rnode[1] == n) ->
       if :: rst[0] == DIRECT && rnode[0] == n -> r = 0 :: rst[1] == DIRECT && rnode[1] == n -> r = 1 fi;
       if
       :: DIRECT_OK(n) -> write(n); rst[r] = OK; rmid[r] = skey; lk[n] = 0
       :: else ->                                                /* FencingError: _lost */
          lost(n);
#ifdef MUTANT_FENCE_NO_LOOKUP
          rst[r] = FAIL; lk[n] = 0                               /* -32603 without a lookup */
#else
          rst[r] = FLOOK
#endif
       fi;
       check_answer(r);
       if                                                        /* its connection closed */
       :: CAN_FAULT && (rst[r] == OK || rst[r] == FAIL) -> faults++; rst[r] = LOST; lostc = true
       :: else
       fi;
       r = 0 }

  /* _insert's failure path: _find_after_failure (a read needs no lease) */
  :: atomic { (rst[0] == FLOOK && rnode[0] == n) || (rst[1] == FLOOK && rnode[1] == n) ->
       if :: rst[0] == FLOOK && rnode[0] == n -> r = 0 :: rst[1] == FLOOK && rnode[1] == n -> r = 1 fi;
       if
       :: skey != 0 -> rst[r] = OK; rmid[r] = skey               /* another node inserted it */
       :: else -> rst[r] = FAIL
       fi;
       lk[n] = 0; check_answer(r); r = 0 }

  /* TurnRunner._work -> PostgresCoordinator.next (hold: after its turn) or SessionInbox.steer (steer: mid-turn, once woken),
     under the session lock: the owner's worker inserts the oldest queued row; the insert
     settles the row and notifies its outcome in one statement. A dead origin's row is
     abandoned */
  :: atomic { work[n] && lk[n] == 0 && (!turn[n] || policy == STEER) && ANYQ ->
       q = QROW;
       if
       :: !ALIVE(qorig[q]) -> settle(q, ABANDONED)
#ifndef MUTANT_NO_QUEUE_INSERT
       :: ALIVE(qorig[q]) && FENCE_OK(n) ->
          write(n); settle(q, INSERTED)
#endif
       :: ALIVE(qorig[q]) && !FENCE_OK(n) -> lost(n)            /* lease lost */
       :: ALIVE(qorig[q]) && CAN_FAULT && skey == 0 ->
          /* the insert failed, and _find_after_failure found no key: PgCluster.fail (a key
             found is answered as recorded, as the insert itself would) */
          faults++; settle(q, RFAILED)
       fi; q = 0 }
#ifdef MUTANT_ROW_UNGUARDED
  /* the owner read the row before it was withdrawn and inserts it anyway */
  :: atomic { work[n] && lk[n] == 0 && (!turn[n] || policy == STEER) &&
              (qs[0] == WITHDRAWN || qs[1] == WITHDRAWN) && FENCE_OK(n) ->
       q = (qs[0] == WITHDRAWN -> 0 : 1); write(n); qs[q] = INSERTED; qkey[q] = skey; q = 0 }
#endif

  /* PostgresCoordinator.next with nothing queued: the worker stops and the lease is kept,
     idle, for its grace (no statement) */
  :: atomic { !stall[n] && work[n] && !turn[n] && lk[n] == 0 && !ANYQ -> work[n] = false }

  /* the grace has passed (at any step: time is abstract): PgCluster.release, owner and
     epoch must match, refused while rows are queued: then the worker starts again and
     inserts them */
  :: atomic { !stall[n] && myep[n] != 0 && !work[n] && lk[n] == 0 ->
       if
#ifndef MUTANT_RELEASE_QUEUED
       :: HOLDS(n) && ANYQ ->
#ifndef MUTANT_NO_PICKUP
          work[n] = true
#else
          skip                                       /* refused, and the owner stays idle */
#endif
       :: HOLDS(n) && !ANYQ -> lown = 0; lexp = false; myep[n] = 0
#else
       :: HOLDS(n) -> lown = 0; lexp = false; myep[n] = 0   /* released with rows queued */
#endif
       :: !HOLDS(n) -> myep[n] = 0                   /* not ours any more: _lost */
       fi }

  /* the turn ends */
  :: atomic { !stall[n] && turn[n] -> turn[n] = false }

  /* _maintain -> renew (one statement for every lease the node holds, active or idle) and
     heartbeat, only when it changes something: a stalled node resumes (its lease is kept
     if nobody took it), or a node learns its lease is lost and drops it at once
     (MUTANT_RENEW_IGNORES_LOST and MUTANT_NO_IDLE_POLL are no guards of C1-C7 or L: the
     fence refuses a stale owner's next write, which drops the lease, and the release after
     the grace picks up what a lost wake-up left queued; docs/verification.md) */
#ifndef MUTANT_RENEW_IGNORES_LOST
  :: atomic { stall[n] || (myep[n] != 0 && !HOLDS(n)) ->
#else
  :: atomic { stall[n] ->
#endif
       stall[n] = false;
       if
       :: myep[n] != 0 && HOLDS(n) -> lexp = false
#ifndef MUTANT_RENEW_IGNORES_LOST
       :: myep[n] != 0 && !HOLDS(n) -> lost(n)                       /* _lost */
#endif
       :: else
       fi }

  /* _listen -> _outcome: the NOTIFY of a row's outcome reaches this node */
  :: atomic { !stall[n] && note[n] -> note[n] = false; answer_rows(n) }

  /* _listen -> _wake: the NOTIFY of a prompt queued behind this node reaches it; an idle
     owner starts its worker */
  :: atomic { !stall[n] && wake[n] -> wake[n] = false;
#ifndef MUTANT_NO_PICKUP
       if :: myep[n] != 0 && ANYQ -> work[n] = true :: else fi
#endif
     }
#if !defined(MUTANT_NO_IDLE_POLL) && !defined(MUTANT_NO_PICKUP)
  /* _maintain -> _poll of the sessions it holds idle, only when it finds a row queued: the
     owner starts its worker (a lost NOTIFY does not leave the row waiting for the grace) */
  :: atomic { !stall[n] && myep[n] != 0 && !work[n] && ANYQ -> work[n] = true }
#endif
#ifndef MUTANT_NO_POLL
  /* _maintain -> _poll, only when it finds something: a row with an outcome, or a queued
     row whose lease is free or expired (_take_over: this node becomes the owner) */
  :: atomic { !stall[n] && TO_ANSWER(n) -> answer_rows(n) }
#ifndef MUTANT_NO_TAKEOVER
  :: atomic { !stall[n] && myep[n] == 0 && (lown == 0 || lexp) &&
              ((rst[0] == WROW && rnode[0] == n && qs[rrow[0]] == QUEUED) ||
               (rst[1] == WROW && rnode[1] == n && qs[rrow[1]] == QUEUED)) ->
       assert(lown != 0);                    /* C7: queued behind an owner, now expired */
       take(n) }
#endif
#endif

  /* $/cancel_request of a request waiting on its row: PgCluster.withdraw; this node's
     waiters are answered from its outcome, the others' by NOTIFY */
  :: atomic { CAN_FAULT && !stall[n] && ((rst[0] == WROW && rnode[0] == n && qs[rrow[0]] == QUEUED) ||
                            (rst[1] == WROW && rnode[1] == n && qs[rrow[1]] == QUEUED)) ->
       faults++;
       if :: rst[0] == WROW && rnode[0] == n && qs[rrow[0]] == QUEUED -> q = rrow[0]
          :: rst[1] == WROW && rnode[1] == n && qs[rrow[1]] == QUEUED -> q = rrow[1] fi;
       withdraw_row(q); answer_rows(n); q = 0 }

  /* session/cancel (or close) on this node: PgCluster.cancel_session withdraws every queued
     row (as withdraw does) and tells the owner to cancel its turn */
  :: atomic { CAN_FAULT && !stall[n] -> faults++;
       withdraw_row(0); withdraw_row(1);
       if :: lown != 0 -> turn[NODE(lown)] = false :: else fi;
       answer_rows(n) }

  /* faults, each guarded as a whole (none can block half-way) */
  :: atomic { CAN_FAULT && note[n] -> faults++; note[n] = false }        /* a NOTIFY lost */
  :: atomic { CAN_FAULT && wake[n] -> faults++; wake[n] = false }        /* a wake-up lost */
  :: atomic { CAN_FAULT && !stall[n] -> faults++; stall[n] = true }      /* stalled past the TTL */
  :: atomic { CAN_FAULT && inc[n] < 2 -> faults++;                       /* SIGKILL, restarted */
       inc[n]++; lost(n); stall[n] = false; note[n] = false; wake[n] = false;
       lk[n] = 0; stuck[n] = false;
       if :: OPEN(0) && rnode[0] == n -> rst[0] = LOST; lostc = true :: else fi;
       if :: OPEN(1) && rnode[1] == n -> rst[1] = LOST; lostc = true :: else fi }
  /* a request's connection closes: its handler is cancelled where it waits */
  :: atomic { CAN_FAULT && ((rst[0] >= SENT && rst[0] <= DIRECT && rnode[0] == n) || rst[0] == WROW && rnode[0] == n ||
                            (rst[1] >= SENT && rst[1] <= DIRECT && rnode[1] == n) || rst[1] == WROW && rnode[1] == n) ->
       faults++; lostc = true;
       if
       :: (rst[0] == SENT || rst[0] == ADMIT || rst[0] == DIRECT || rst[0] == WROW) && rnode[0] == n -> r = 0
       :: (rst[1] == SENT || rst[1] == ADMIT || rst[1] == DIRECT || rst[1] == WROW) && rnode[1] == n -> r = 1
       fi;
       if
       :: rst[r] == DIRECT ->
          /* cancelled in _insert before the fenced insert committed: nothing written, the
             prompt ended -32800 with its key unused (nobody else waits on it: the lock) */
          lk[n] = 0
       :: rst[r] == ADMIT ->
          /* cancelled in find_key or PgCluster.admit: _abandon settles the pending (-32800,
             nobody joined: the lock) and unregisters the key. The admit's transaction may
             have committed first: a row queued that no request here waits on, or the lease
             taken without the node knowing it (it is never renewed: it expires) */
#ifdef MUTANT_CANCEL_ADMIT
          stuck[n] = true;                         /* the pending left registered */
#endif
          lk[n] = 0;
          if
          :: skip
          :: ANYQ -> skip                          /* attached */
          :: !ANYQ && !TAKEABLE -> queue_row(n, r)
          :: !ANYQ && TAKEABLE ->
             if :: lown != 0 && !lexp -> skip :: else -> over[1 - n] = true fi;
             new_epoch(); lown = ME(n); lexp = false
          fi
       :: rst[r] == WROW ->
          /* detach: the last waiter anywhere leaving drops a queued row (no waiters) */
          if
          :: qs[rrow[r]] == QUEUED && !(rst[1 - r] == WROW && rrow[1 - r] == rrow[r]) ->
             settle(rrow[r], DROPPED)
          :: else
          fi
       :: else
       fi;
       rst[r] = LOST; r = 0 }
  od
}

/* the lease expires: its owner is dead, stalled, or does not know it holds it */
proctype clock() {
end:
  do
  :: atomic { lown != 0 && !lexp &&
              (lown != ME(NODE(lown)) || stall[NODE(lown)] || myep[NODE(lown)] != lep) -> lexp = true }
  od
}

/* the client: one submission, resent to either node with the same key until answered. A
   resend follows an error or a lost answer; one that overlaps an open attempt costs a fault.
   After error answers only (none lost), it may give up. */
#define RESENDABLE(x) (rst[x] == FREE || rst[x] >= CANC)
#define ERRED(x) (rst[x] == CANC || rst[x] == FAIL)
proctype client() {
  byte got;
  do
  :: atomic { rst[0] == OK -> got = rmid[0]; break }
  :: atomic { rst[1] == OK -> got = rmid[1]; break }
  :: atomic { RESENDABLE(0) && !OPEN(1) && rst[1] != OK ->
       rst[0] = SENT; rrow[0] = NOR; if :: rnode[0] = 0 :: rnode[0] = 1 fi }
  :: atomic { rst[0] != FREE && RESENDABLE(1) && !OPEN(0) && rst[0] != OK ->
       rst[1] = SENT; rrow[1] = NOR; if :: rnode[1] = 0 :: rnode[1] = 1 fi }
  :: atomic { CAN_FAULT && RESENDABLE(0) && OPEN(1) -> faults++;
       rst[0] = SENT; rrow[0] = NOR; if :: rnode[0] = 0 :: rnode[0] = 1 fi }
  :: atomic { CAN_FAULT && RESENDABLE(1) && OPEN(0) -> faults++;
       rst[1] = SENT; rrow[1] = NOR; if :: rnode[1] = 0 :: rnode[1] = 1 fi }
  :: atomic { !lostc && ERRED(0) && (ERRED(1) || rst[1] == FREE) -> quit = true; cdone = true; goto gone }
  od;
  assert(got != 0 && got == skey && nmsg == 1);          /* C6 */
  cdone = true;
gone:
  skip
}

ltl done { <> cdone }

init {
  atomic {
    if :: policy = HOLD :: policy = STEER fi;
    if
    :: skip                                               /* the session is idle */
    :: lown = ME(0); lep = 1; myep[0] = 1; turn[0] = true; work[0] = true  /* node 0 runs a turn */
    fi;
    run node(0); run node(1); run clock(); run client()
  }
}
