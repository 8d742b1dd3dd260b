/*
 * cluster.pml: two SessionAgent nodes on one PostgreSQL database, one session, one client
 * submission (one key) that the client resends to either node.
 *
 * Each `atomic` is one transaction or the code between two awaits; the comment names the
 * function in src/ (acp_once.cluster: the coordinator and its SQL; acp_once.storage.postgres:
 * the fenced insert). A node is one process: its steps interleave with the other node's.
 *
 * Bounds: 2 nodes, 1 key, 2 request slots (a resend may overlap an attempt the client gave
 * up on), FAULTS faults in all: a node killed (restarted as a new instance), a node stalled
 * longer than the lease TTL (a stale owner), a lost NOTIFY, a connection closed, a
 * $/cancel_request. At start the session is idle, or node 0 owns it with a turn running (so
 * a prompt is queued for it).
 *
 * Properties:
 *  C1 at most one user message for the key                          [every write]
 *  C2 every success answer carries the message's id                 [answer]
 *  C3 a withdrawn queued prompt is never inserted; it is withdrawn (-32800) only while its
 *     key is unused
 *  C4 a write succeeds only under the current lease (owner, epoch): a stale owner's is refused
 *  C5 no turn runs on two nodes at once, except on a stale owner (one that stalled past the
 *     TTL: it learns at its next renewal, and its writes are refused meanwhile)
 *  C6 once the faults are spent, the retrying client gets the id, inserted exactly once
 *     (a request blocked forever is an invalid end state)
 */

#ifndef FAULTS
#define FAULTS 2
#endif
#define CAN_FAULT (faults < FAULTS)

/* request status */
#define FREE 0
#define SENT 1      /* on the wire */
#define ADMIT 2     /* find_key found nothing: PgCluster.admit next */
#define DIRECT 3    /* this node took (or holds) the lease: agent._insert next */
#define WROW 4      /* waiting on the queued row (NOTIFY or the poll) */
#define OK 5
#define CANC 6
#define FAIL 7
#define LOST 8

/* queued row (prompt_queue.state) */
#define NOROW 0
#define QUEUED 1
#define INSERTED 2
#define WITHDRAWN 3
#define ABANDONED 4

byte rst[2]; byte rnode[2]; byte rmid[2];

/* the database */
byte lown;          /* session_leases.owner: an instance id (1 + node + 2 * incarnation), 0 free */
byte lep;           /* session_leases.epoch: the fencing token */
bool lexp;          /* expires_at < now() */
byte qst;           /* the key's queued row */
byte qorig;         /* the instance that queued it */
byte skey;          /* message id recorded with the key; 0 unused */
byte nmsg;          /* ghost: user messages stored for the key */
bool note[2];       /* a NOTIFY of the row's outcome on its way to node n */
bool wdrow;         /* ghost: the row was withdrawn */

/* the nodes' memory */
byte inc[2];        /* incarnation: a killed node comes back as a new instance */
byte myep[2];       /* coordinator.leases[session]: the epoch it believes it holds, 0 none */
bool turn[2];       /* a turn runs there */
bool stale[2];      /* ghost: stalled past the TTL since it took the lease */
byte faults;
byte mids;          /* message ids handed out (new_id) */

#define ME(n) (1 + (n) + 2 * inc[n])
#define LIVE_OWNER (lown != 0 && lown == ME((lown - 1) % 2))
#define HOLDS(n) (lown == ME(n) && lep == myep[n])
#ifdef MUTANT_NO_FENCE
#define FENCE_OK(n) true                 /* the write does not check the fence */
#else
#define FENCE_OK(n) HOLDS(n)
#endif
#ifdef MUTANT_TAKE_UNEXPIRED
#define TAKEABLE true                    /* taken whether or not it expired */
#else
#define TAKEABLE (lown == 0 || lexp)
#endif
#ifdef MUTANT_ROW_UNGUARDED
#define ROW_OK true                      /* the insert does not require state = 'queued' */
#else
#define ROW_OK (qst == QUEUED)
#endif

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

inline start_turn(n) {
  /* C5 */
  assert(!(turn[1 - n] && !stale[1 - n] && !stale[n]));
  turn[n] = true
}

inline write(n, r) {       /* the fenced insert's transaction wrote the message and its key */
  assert(HOLDS(n));        /* C4 */
  if
  :: skey == 0 -> mids++; skey = mids; nmsg++; assert(nmsg <= 1)   /* C1 */
  :: else      /* the key is recorded: InsertOutcome(inserted=False) */
  fi
}

inline answer_row(n, st) {   /* _outcome: every request of node n waiting on the row */
  if :: rst[0] == WROW && rnode[0] == n -> rst[0] = st; rmid[0] = (st == OK -> skey : 0) :: else fi;
  if :: rst[1] == WROW && rnode[1] == n -> rst[1] = st; rmid[1] = (st == OK -> skey : 0) :: else fi;
  if :: st == ADMIT -> skip :: else -> assert(st != OK || skey != 0) fi
}

proctype node(byte n) {
  byte r;
end:
  do
  /* SessionAgent.prompt -> PostgresCoordinator._admit: not the owner, find_key first */
  :: atomic { (rst[0] == SENT && rnode[0] == n) || (rst[1] == SENT && rnode[1] == n) ->
       if :: rst[0] == SENT && rnode[0] == n -> r = 0 :: rst[1] == SENT && rnode[1] == n -> r = 1 fi;
       if
       :: myep[n] != 0 && !turn[n] -> rst[r] = DIRECT       /* owner, idle: insert now */
       :: myep[n] != 0 && turn[n] ->                         /* owner, busy: _enqueue_owned */
          if
          :: HOLDS(n) ->
             if :: qst != QUEUED -> qst = QUEUED; qorig = ME(n); wdrow = false :: else fi;
             rst[r] = WROW
          :: else -> myep[n] = 0; turn[n] = false; stale[n] = false; rst[r] = ADMIT   /* _lost */
          fi
       :: myep[n] == 0 && skey != 0 -> rst[r] = OK; rmid[r] = skey    /* recorded: any node */
       :: myep[n] == 0 && skey == 0 -> rst[r] = ADMIT
       fi; r = 0 }

  /* PgCluster.admit (epoch None): lock the lease; take it if free or expired, else queue */
  :: atomic { (rst[0] == ADMIT && rnode[0] == n) || (rst[1] == ADMIT && rnode[1] == n) ->
       if :: rst[0] == ADMIT && rnode[0] == n -> r = 0 :: rst[1] == ADMIT && rnode[1] == n -> r = 1 fi;
       if
       :: TAKEABLE ->            /* _take: epoch + 1, the dead instances' rows abandoned */
          new_epoch(); lown = ME(n); lexp = false; myep[n] = lep; stale[n] = false;
          if :: qst == QUEUED && qorig != ME((qorig - 1) % 2) -> qst = ABANDONED; note[0] = true; note[1] = true :: else fi;
          if
          :: qst == QUEUED -> rst[r] = WROW      /* backlog: behind the queued prompt (its key) */
          :: else -> rst[r] = DIRECT
          fi
       :: else ->                /* a live owner: queue, or attach to the row with the key */
          if :: qst != QUEUED -> qst = QUEUED; qorig = ME(n); wdrow = false :: else fi;
          rst[r] = WROW
       fi; r = 0 }

  /* agent._insert through FencedStore.insert_user_message: one fenced statement */
  :: atomic { (rst[0] == DIRECT && rnode[0] == n) || (rst[1] == DIRECT && rnode[1] == n) ->
       if :: rst[0] == DIRECT && rnode[0] == n -> r = 0 :: rst[1] == DIRECT && rnode[1] == n -> r = 1 fi;
       if
       :: FENCE_OK(n) -> write(n, r); rst[r] = OK; rmid[r] = skey; start_turn(n)
       :: else -> rst[r] = FAIL; myep[n] = 0; turn[n] = false; stale[n] = false  /* FencingError */
       fi;
       assert(rst[r] != OK || rmid[r] == skey); r = 0 }

  /* _worker -> insert_next: the owner, idle, inserts the queued row (it settles the row) */
  :: atomic { myep[n] != 0 && !turn[n] && qst == QUEUED ->
       if
       :: qorig != ME((qorig - 1) % 2) -> qst = ABANDONED; note[0] = true; note[1] = true  /* origin dead */
       :: qorig == ME((qorig - 1) % 2) ->
          if
          :: FENCE_OK(n) && ROW_OK ->
             assert(!wdrow);                      /* C3 */
             write(n, 0); qst = INSERTED; note[0] = true; note[1] = true; start_turn(n)
          :: else -> myep[n] = 0; turn[n] = false; stale[n] = false   /* fenced: lease lost */
          fi
       fi }
#ifdef MUTANT_ROW_UNGUARDED
  /* the owner read the row before it was withdrawn and inserts it anyway */
  :: atomic { myep[n] != 0 && !turn[n] && qst == WITHDRAWN && FENCE_OK(n) ->
       assert(!wdrow); write(n, 0); qst = INSERTED; start_turn(n) }
#endif

  /* insert_next with nothing queued: PgCluster.release (owner and epoch must match) */
  :: atomic { myep[n] != 0 && !turn[n] && qst != QUEUED ->
       if :: HOLDS(n) -> lown = 0; lexp = false :: else fi; myep[n] = 0; stale[n] = false }

  /* the turn ends */
  :: turn[n] -> turn[n] = false

  /* _maintain -> PgCluster.renew: keep the lease, or learn it is lost (_lost) */
  :: atomic { myep[n] != 0 ->
       if
       :: HOLDS(n) -> lexp = false
       :: else -> myep[n] = 0; turn[n] = false; stale[n] = false
       fi }

  /* _listen -> _outcome: the NOTIFY of the row's outcome reaches this node */
  :: atomic { note[n] && qst >= INSERTED ->
       note[n] = false;
       if
       :: qst == INSERTED -> answer_row(n, OK)
       :: qst == WITHDRAWN -> answer_row(n, CANC)
       :: qst == ABANDONED -> answer_row(n, ADMIT)   /* _readmit: submitted again */
       fi }
#ifndef MUTANT_NO_POLL
  /* _maintain -> _poll: the rows it waits on, every poll_interval (a lost NOTIFY's net) */
  :: atomic { (rst[0] == WROW && rnode[0] == n) || (rst[1] == WROW && rnode[1] == n) ->
       if
       :: qst == INSERTED -> answer_row(n, OK)
       :: qst == WITHDRAWN -> answer_row(n, CANC)
       :: qst == ABANDONED -> answer_row(n, ADMIT)
       :: qst == QUEUED && myep[n] == 0 && (lown == 0 || lexp) ->   /* _take_over */
          new_epoch(); lown = ME(n); lexp = false; myep[n] = lep; stale[n] = false
       :: else -> skip
       fi }
#endif

  /* $/cancel_request of a request waiting on the row: PgCluster.withdraw. It first waits for
     the owner's fenced insert in flight (the lease row's lock), then settles a row whose key
     is recorded already as `recorded` (answered with the message id), and withdraws it only
     while the key is unused */
  :: atomic { CAN_FAULT && ((rst[0] == WROW && rnode[0] == n) || (rst[1] == WROW && rnode[1] == n)) ->
       faults++;
       if
#ifndef MUTANT_WITHDRAW_RECORDED
       :: qst == QUEUED && skey != 0 -> qst = INSERTED; note[0] = true; note[1] = true;
          answer_row(n, OK)
       :: qst == QUEUED && skey == 0 ->
#else
       /* the guard removed: withdrawn on `state = 'queued'` alone */
       :: qst == QUEUED ->
#endif
          assert(skey == 0);           /* C3: -32800 only while the key is unused */
          qst = WITHDRAWN; wdrow = true; note[0] = true; note[1] = true;
          answer_row(n, CANC)
       :: else -> skip                 /* inserted first: insertion wins (R27) */
       fi }

  /* faults */
  :: atomic { CAN_FAULT -> faults++;
       if
       :: note[n] -> note[n] = false                        /* a NOTIFY lost */
       :: myep[n] != 0 && !stale[n] -> stale[n] = true      /* stalled past the TTL */
       :: inc[n] < 2 ->                                     /* SIGKILL, restarted anew */
          inc[n]++; myep[n] = 0; turn[n] = false; stale[n] = false; note[n] = false;
          if :: rst[0] != FREE && rst[0] < OK && rnode[0] == n -> rst[0] = LOST :: else fi;
          if :: rst[1] != FREE && rst[1] < OK && rnode[1] == n -> rst[1] = LOST :: else fi
       :: (rst[0] == SENT || rst[0] == WROW) && rnode[0] == n -> rst[0] = LOST   /* connection closed */
       :: (rst[1] == SENT || rst[1] == WROW) && rnode[1] == n -> rst[1] = LOST
       fi }
  od
}

/* the lease expires: its owner is dead, or stalled past the TTL */
proctype clock() {
end:
  do
  :: atomic { lown != 0 && !lexp && (!LIVE_OWNER || stale[(lown - 1) % 2]) -> lexp = true }
  od
}

/* the client: one submission, resent to either node with the same key until answered */
proctype client() {
  byte got;
  do
  :: atomic { rst[0] == OK -> got = rmid[0]; break }
  :: atomic { rst[1] == OK -> got = rmid[1]; break }
  :: atomic { (rst[0] == FREE || rst[0] >= CANC) && rst[1] != OK ->
       rst[0] = SENT; if :: rnode[0] = 0 :: rnode[0] = 1 fi }
  :: atomic { (rst[1] == FREE || rst[1] >= CANC) && rst[0] != OK ->
       rst[1] = SENT; if :: rnode[1] = 0 :: rnode[1] = 1 fi }
  od;
  assert(got != 0 && got == skey && nmsg == 1)          /* C6 */
}

init {
  atomic {
    if
    :: skip                                               /* the session is idle */
    :: lown = ME(0); lep = 1; myep[0] = 1; turn[0] = true /* node 0 runs a turn */
    fi;
    run node(0); run node(1); run clock(); run client()
  }
}
