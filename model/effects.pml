/*
 * effect-gateway: an exhaustive model of one effect record's state machine, in Promela for spin.
 *
 * Two clients retry the same (tenant, upstream, key), each through a gateway of its own; the gateways
 * share nothing but the store and the upstream. A gateway may crash at any await point (its local state
 * is lost, its store writes and the requests it sent are not) and may stall between any two steps for
 * as long as it likes, except where the design bounds it (below). Each store statement is one atomic
 * step, fenced by the attempt number as the design says. The upstream keeps a ledger of the effects it
 * performed; an operator resolves records truthfully from that ledger; the retention drops a completed
 * record's response at any moment. model/README.md says what is covered and what is left out;
 * model/check.py runs the checks, every MUTATION_* switch below must make them fail, and every
 * FINDING_* switch reproduces a hole in the code as it stood when the model was written.
 *
 * Time is counted in ticks of the database's clock. Every time the design compares is kept as an age
 * or a time left, saturating where no decision depends on it any more, so the clock runs without bound
 * and the state space stays finite. What the design assumes of time, and the model enforces:
 *   - a request that left the gateway lands at the upstream, or is abandoned, within TIMEOUT ticks;
 *   - a gateway's request leaves within GRACE ticks of the statement that gave it its lease (the lease
 *     is TIMEOUT + GRACE: "the upstream finishes or abandons a request within that time").
 */

/* --- sizes and times (ticks); each can be overridden with -D ------------------------------------------ */
#ifndef TIMEOUT
#define TIMEOUT 1      /* a request lands in the tick it left: the upstream's timeout at tick resolution */
#endif
#ifndef GRACE
#define GRACE 1        /* the gateway's own steps between taking a lease and its request leaving */
#endif
#define LEASE (TIMEOUT + GRACE)
#ifndef TTL
#define TTL 4          /* the upstream forgets a native key TTL ticks after the effect that stored it */
#endif
#ifndef HORIZON
#define HORIZON 3      /* the probe's search sees effects that landed fewer than HORIZON ticks ago */
#endif
#ifndef LAG
#define LAG 1          /* ... and lists an effect only LAG ticks after it landed (an index that refreshes) */
#endif
#if LAG >= HORIZON
#error "LAG must be shorter than HORIZON: the search would never list an effect it still sees"
#endif
#ifndef REQUESTS
#define REQUESTS 2     /* requests per client: a first try and one retry */
#endif
#ifndef MAXCRASH
#define MAXCRASH 2     /* gateway crashes in one run */
#endif
#define SLOTS 2        /* requests in flight at once: the design has one, a broken rule two; more is reported */

/* A write by the holder of attempt a: fenced on the attempt and on the pending state it holds, as the
   code's `where attempt = $3 and state = $4`. Sending to review and an operator's verdict keep the
   attempt number (every view names the attempt judged), so the state is what fences a stalled holder
   out after them. */
#ifndef MUTATION_FENCE_ATTEMPT_ONLY
#define HOLDS(a) (att == a && st == pending)
#else
#define HOLDS(a) (att == a)
#endif

#ifdef MUTATION_MARGIN_ZERO
#define MARGIN 0
#elif defined(MARGIN_TICKS)
#define MARGIN MARGIN_TICKS  /* to find the smallest margin that holds (model/README.md) */
#else
#define MARGIN LEASE   /* the design: a native key counts as fresh while its age < TTL - one lease */
#endif
/* first_sent's age is compared with TTL - MARGIN and HORIZON at most: it saturates at the larger */
#define SENT_CAP ((TTL > HORIZON) -> TTL : HORIZON)

/* --- names: the record's states, and why a request is sent ------------------------------------------ */
mtype = { nothing, pending, completed, retryable, in_doubt, needs_review };
mtype = { first_try, resend_retryable, resend_never_sent, resend_native_key, send_probe_not_found,
          resend_harmless, resend_purged };

/* --- upstream kinds ---------------------------------------------------------------------------------- */
#define K_NATIVE 0     /* native idempotency key with a TTL */
#define K_PROBE 1      /* stamp + probe with a horizon */
#define K_BOTH 2       /* native key and probe (the Stripe-like payments upstream) */
#define K_NEITHER 3    /* neither: recovery ends in needs_review */
#define K_HARMLESS 4   /* neither, and repeats are harmless: duplicates allowed */
byte kind;
#define has_native (kind == K_NATIVE || kind == K_BOTH)
#define has_probe (kind == K_PROBE || kind == K_BOTH)
#define is_harmless (kind == K_HARMLESS)

/* Variables that are no part of the state (constants, and what only the trail prints): left out of the
 * state vector, except for a breadth-first search (model/check.py uses one for the shortest trail),
 * which refuses hidden variables. */
#ifdef BFS_SEARCH
#define HIDDEN
#else
#define HIDDEN hidden
#endif

/* --- the transition table: the only place transitions are listed ------------------------------------ */
HIDDEN byte table[8];  /* table[from]: a bit for each state it may move to (states are mtype values 1-6) */
#define ALLOWED(from, to) ((table[from] >> (to)) & 1)
inline allow(from, to) { table[from] = table[from] | (1 << to) }
inline transition_table() {
	allow(nothing, pending);
	/* settled; taken over after its lease (attempt + 1); given up on; resolved after its lease */
	allow(pending, completed); allow(pending, retryable); allow(pending, in_doubt);
	allow(pending, pending); allow(pending, needs_review);
	allow(retryable, pending);
	/* re-sent or probed (pending); resolved by an operator; given up on */
	allow(in_doubt, pending); allow(in_doubt, completed); allow(in_doubt, retryable);
	allow(in_doubt, needs_review);
	allow(needs_review, completed); allow(needs_review, retryable);
	/* completed: no way out. The retention drops the response; the state stays; a probe that finds
	   the effect may put a response back (completed -> completed, as gateway/states.py lists it). */
	allow(completed, completed)
}

/* --- the store: the one row ------------------------------------------------------------------------- */
HIDDEN mtype shown;    /* for the trail only */
mtype st = nothing;    /* state */
byte att;              /* the version writes are fenced on: raised by every claim, re-claim, review
                        * and resolution (the code keeps its attempt number on a review or a
                        * resolution, and fences every write on the state as well, which they change) */
bool mhs;              /* may_have_sent */
byte lease_left;       /* lease_expires_at - now, 0 once it has run out */
byte sent_age;         /* now - first_sent_at, saturating at SENT_CAP */
bool has_resp;         /* a stored response (false after the retention purged it) */
byte resp;             /* its id */
/* Ticks until a probe's "not found" can be trusted: LAG after the latest attempt could have acted, which
 * is when its answer was recorded, else when its lease ends (last_sent_at + lease). 0: trusted now. */
byte lag_left;

/* --- the upstream: its ledger, its native-key memory, requests in flight -------------------------- */
#define REJECTED 9     /* the response id of a definitive refusal (a 4xx): nothing happened */
byte effects;          /* effects performed; effect n answers 2xx with response id n */
byte eff_age;          /* age of the first effect, saturating at HORIZON (the probe stops seeing it) */
bool key_set;          /* a native key is stored, */
byte key_age;          /* this old (saturating at TTL: forgotten), */
byte key_resp;         /* replaying this response */
bool infl[SLOTS];      /* a request in flight */
byte sdl[SLOTS];       /* ticks left before it must have landed or been abandoned */
byte sowner[SLOTS];    /* the gateway that sent it */
mtype sreason[SLOTS];  /* why it was sent */

/* what a gateway got back */
#define A_NONE 0       /* nothing (yet): a timeout or reset when it stops waiting */
#define A_OK 1         /* 2xx */
#define A_4XX 2        /* a definitive refusal */
#define A_5XX 3        /* may have happened */
#define A_NOTSENT 4    /* the connection was refused before the request left */

/* --- the gateways ------------------------------------------------------------------------------------ */
#define NODL 255
byte dl[2];            /* a gateway holding a fresh lease must send (or crash) within this many ticks */
byte waiting[2];       /* slot + 1 whose answer the gateway waits for; 0: none */
byte ans[2];
byte ansid[2];
byte crashes;
bool stopped[2];       /* the client got its final answer and stopped retrying */
byte finished;         /* clients that are done */

/* --- ghost: what clients were told ------------------------------------------------------------------- */
byte got;              /* the definitive answer (a response id) the first client was given; 0: none yet */

/* A checked property: the trail (spin -t) names the one that failed. */
#define CHECK(cond, msg) if :: !(cond) -> printf(msg) :: else -> skip fi; assert(cond)

/* Reachability witnesses: with -DWITNESS=n, reaching REACH(n) is reported as an error. model/check.py
 * expects every one of them to be reached, so no branch of the model is silently dead. */
#ifdef WITNESS
#define REACH(n) assert(WITNESS != n)
#else
#define REACH(n) skip
#endif
#define W_REPLAY 1
#define W_DEDUP 2                /* the upstream deduplicates a re-send by its native key */
#define W_NATIVE_RESEND 3        /* a re-claim to re-send under the native key */
#define W_KEY_STALE_AT_RECLAIM 4 /* the re-claim's own check finds the key too old */
#define W_PROBE_FOUND 5
#define W_PROBE_NOT_FOUND 6      /* within the horizon: sent */
#define W_PROBE_BLIND 7          /* past the horizon: needs_review */
#define W_PROBE_FAILED 8
#define W_PURGED_FOUND 9         /* the probe supplies a purged response */
#define W_PURGED_GONE 10         /* 410 response-purged */
#define W_REVIEW 11              /* nothing can tell, without a probe: needs_review */
#define W_HARMLESS_REPEAT 12     /* a harmless upstream performs the effect again */
#define W_OPERATOR_HAPPENED 13
#define W_OPERATOR_NOT 14
#define W_FENCED_OUT 15
#define W_TAKEN_OVER 16          /* a pending record whose lease ran out is re-claimed */
#define W_RECLAIM_REFUSED 17     /* the re-claim finds the record no longer as it was decided on */
#define W_STICKY 18              /* a refused attempt after an earlier may-have-sent stays in doubt */
#define W_REFUSED_4XX 19         /* a definitive refusal completes the record */
#define W_CRASH_PENDING 20       /* clients stopped with the record pending (its holder crashed) */
#define W_PROBE_TOO_SOON 21      /* "not found" too soon for the search to list the effect: in_doubt */
#define WITNESSES 21

#ifndef ONLY_USER_VISIBLE
#define STRUCTURAL 1
#endif

/* needs_review only where nothing could tell: something may have reached the upstream, no native key
 * is young enough to re-send under (with the design's margin), no probe can still see the effect, and
 * repeats are not harmless. */
inline check_review() {
	CHECK(mhs || st == pending, "VIOLATED: needs_review although nothing can have reached the upstream\n");
	CHECK(!is_harmless, "VIOLATED: needs_review on an upstream where repeats are harmless\n");
	CHECK(!(has_native && sent_age < TTL - LEASE), "VIOLATED: needs_review while the native key was usable\n");
	CHECK(!(has_probe && sent_age < HORIZON), "VIOLATED: needs_review while the probe could see the effect\n")
}

inline set_state(to) {
	shown = to;        /* printm of a constant upsets spin's analysis: print a variable */
	printf("        record: "); printm(st); printf(" -> "); printm(shown); printf("\n"); shown = 0;
#ifdef STRUCTURAL
	CHECK(ALLOWED(st, to), "VIOLATED: a transition that is not in the table\n");
	CHECK(st != completed, "VIOLATED: a completed record left completed\n");
	if
	:: to == needs_review -> check_review()
	:: else -> skip
	fi;
#endif
	st = to
}

/* A client is given a definitive answer: every one of them, and every replay, is the same response. */
inline answer(id) {
	if
	:: got == 0 -> got = id
	:: else -> CHECK(got == id, "VIOLATED: a client was given another answer than an earlier client\n")
	fi
}

/* The upstream performs the effect. It never happens twice for one key, except when a harmless
 * upstream's request was re-sent because repeats are harmless. */
inline perform(i) {
	effects++;
	printf("upstream: effect #%d happens (gw%d's request, ", effects, sowner[i]); printm(sreason[i]); printf(")\n");
	if
	:: effects > 1 ->
		REACH(W_HARMLESS_REPEAT);
		CHECK(is_harmless && sreason[i] == resend_harmless, "VIOLATED: the effect happened twice\n")
	:: else -> eff_age = 0
	fi;
	if
	:: has_native -> key_set = 1; key_age = 0; key_resp = effects
	:: else -> skip
	fi
}

inline deliver(i, a, id) {
	if
	:: waiting[sowner[i]] == i + 1 -> ans[sowner[i]] = a; ansid[sowner[i]] = id
	:: waiting[sowner[i]] != i + 1 -> skip    /* its gateway crashed or stopped waiting: the answer is lost */
	fi
}

#define KEY_REMEMBERED (has_native && key_set && key_age < TTL)

/* A request lands at the upstream (before its deadline), or is abandoned: every way it can go. An
 * answer the gateway does not take (it stopped waiting first) is lost. */
inline land(i) {
	if
	:: printf("upstream: gw%d's request is abandoned: nothing happens, no answer\n", sowner[i])
	:: KEY_REMEMBERED ->
		REACH(W_DEDUP);
		printf("upstream: native key remembered, replays response %d\n", key_resp);
		deliver(i, A_OK, key_resp)
	:: !KEY_REMEMBERED ->
		perform(i);
		if
		:: printf("upstream: answers 2xx (response %d)\n", effects); deliver(i, A_OK, effects)
		:: printf("upstream: answers 5xx\n"); deliver(i, A_5XX, 0)
		fi
	:: !KEY_REMEMBERED ->
		printf("upstream: answers 5xx, nothing happened\n"); deliver(i, A_5XX, 0)
	:: !KEY_REMEMBERED ->
		printf("upstream: refuses gw%d's request (4xx), nothing happened\n", sowner[i]);
		deliver(i, A_4XX, REJECTED)
	fi;
	infl[i] = 0; sdl[i] = 0; sowner[i] = 0; sreason[i] = 0
}

/* The clock ticks whenever no deadline forbids it; every age grows (up to where it saturates) and every
 * time left shrinks. */
active proctype Clock() {
end:	do
	:: d_step {
		(dl[0] == NODL || dl[0] > 0) && (dl[1] == NODL || dl[1] > 0) &&
		(!infl[0] || sdl[0] > 0) && (!infl[1] || sdl[1] > 0) ->
		if :: lease_left > 0 -> lease_left-- :: else -> skip fi;
		if :: lag_left > 0 -> lag_left-- :: else -> skip fi;
		if :: st != nothing && sent_age < SENT_CAP -> sent_age++ :: else -> skip fi;
		if :: effects > 0 && eff_age < HORIZON -> eff_age++ :: else -> skip fi;
		if :: key_set && key_age < TTL -> key_age++ :: else -> skip fi;
		if :: dl[0] != NODL -> dl[0]-- :: else -> skip fi;
		if :: dl[1] != NODL -> dl[1]-- :: else -> skip fi;
		if :: infl[0] -> sdl[0]-- :: else -> skip fi;
		if :: infl[1] -> sdl[1]-- :: else -> skip fi;
		printf("tick\n")
	   }
	od
}

active proctype Upstream() {
end:	do
	:: atomic { infl[0] -> land(0) }
	:: atomic { infl[1] -> land(1) }
	od
}

/* Retention: a completed record's response is dropped, at any moment after it completed (which covers
 * every retention). The audit row and the state stay. */
active proctype Retention() {
end:	d_step { st == completed && has_resp -> has_resp = 0; printf("retention: response purged\n") }
}

/* An operator resolves a record truthfully from the upstream's ledger: it happened (with the effect's
 * response) or it did not. */
#ifdef FINDING_RESOLVE_DURING_LEASE
#define RESOLVABLE (st == needs_review || st == in_doubt || (st == pending && lease_left == 0))
#else
#define RESOLVABLE (st == needs_review || ((st == in_doubt || st == pending) && lease_left == 0))
#endif
active proctype Operator() {
end:	d_step {
		RESOLVABLE ->
		if
		:: effects > 0 ->
			REACH(W_OPERATOR_HAPPENED); printf("operator: it happened (ledger)\n");
			set_state(completed); has_resp = 1; resp = 1; mhs = 1
		:: else ->
			REACH(W_OPERATOR_NOT); printf("operator: it did not happen (ledger)\n");
			set_state(retryable); mhs = 0
		fi;
		lease_left = 0          /* a verdict keeps the attempt: every view names the one judged */
	}
}

/* Invariants of every state. */
#define ANSWERS_STAND (got == 0 || (st == completed && (!has_resp || resp == got)))
#ifdef STRUCTURAL
#define RETRYABLE_MEANS_UNSENT (st != retryable || !mhs)
#else
#define RETRYABLE_MEANS_UNSENT 1
#endif
active proctype Monitor() {
end:	atomic {
		!(ANSWERS_STAND && RETRYABLE_MEANS_UNSENT) ->
		CHECK(ANSWERS_STAND, "VIOLATED: what a client was given is no longer what the record replays\n");
		CHECK(RETRYABLE_MEANS_UNSENT, "VIOLATED: retryable although an attempt may have reached the upstream\n")
	}
}

/* Once clients stop and requests in flight have landed: the record is completed, retryable, in_doubt or
 * needs_review, or pending with its holder gone, which reads as in_doubt once its lease runs out (the
 * lease is a time left that only shrinks, so it does). */
active proctype Final() {
end:	atomic {
		finished == 2 && !infl[0] && !infl[1] ->
		CHECK(st == completed || st == retryable || st == in_doubt || st == needs_review ||
		      (st == pending && lease_left <= LEASE && dl[0] == NODL && dl[1] == NODL),
		      "VIOLATED: a record is stuck once clients stop\n");
		if
		:: st == pending -> REACH(W_CRASH_PENDING)
		:: else -> skip
		fi
	}
}

/* --- a client, and the gateway serving its current request --------------------------------------- */

/* what decide() said, from the record as read */
#define ACT_SEND 1       /* the claim created the record: attempt 1 is ours */
#define ACT_DONE 2       /* answered at once: a replay, a 409 (twin, lease, outcome-unknown), a 410 */
#define ACT_RECLAIM 3    /* take the record over (why says what for), then send or probe */
#define ACT_REVIEW 4     /* nothing can tell: send it to review */
#define ACT_PURGED 5     /* completed, response purged, a probe configured: ask it for the answer */

/* The probe reads the upstream's ledger at this instant, and "not found" is judged against the horizon
 * at the same instant: any effect landed after first_sent. The search lists an effect from LAG ticks
 * after it landed until it is HORIZON old. Used in atomic, never in d_step: a d_step takes the first
 * open option of an if, so a probe there could only ever fail. */
#define VISIBLE (effects > 0 && eff_age >= LAG && eff_age < HORIZON)
#define P_FAIL 1
#define P_FOUND 2
#define P_NOTFOUND 3     /* within the horizon: nothing happened */
#define P_BLIND 4        /* past the horizon: "not found" tells nothing */
#ifdef MUTATION_HORIZON_IGNORED
#define WITHIN_HORIZON 1
#elif defined(MUTATION_HORIZON_AT_CLAIM)
#define WITHIN_HORIZON young     /* judged when the probe's re-claim was taken, not when the probe ran */
#else
#define WITHIN_HORIZON (sent_age < HORIZON)
#endif
inline probe() {
	if
	:: pr = P_FAIL
	:: VISIBLE -> pr = P_FOUND; oid = 1
	:: !VISIBLE && WITHIN_HORIZON -> pr = P_NOTFOUND
	:: !VISIBLE && !WITHIN_HORIZON -> pr = P_BLIND
	fi
}

/* Whether "not found" can be trusted to have seen the latest attempt's effect: judged when the record was
 * taken over to probe (caught_up), before the probe ran, since the search looked later than that. */
#ifdef MUTATION_LAG_IGNORED
#define TRUSTED 1
#elif defined(MUTATION_LAG_AFTER_PROBE)
#define TRUSTED (lag_left == 0)  /* judged once the probe has answered, as the horizon is */
#else
#define TRUSTED caught_up
#endif
/* What a sending claim or re-claim sets lag_left to: its lease, then the lag. */
#ifdef MUTATION_LAG_FROM_CLAIM
#define SENT_LAG LAG             /* counted from the claim, as if the upstream acted as it was sent */
#else
#define SENT_LAG (LEASE + LAG)
#endif

inline say_probe() {
	if
	:: pr == P_FAIL -> printf("it fails\n")
	:: pr == P_FOUND -> printf("it finds the effect\n")
	:: pr == P_NOTFOUND -> printf("it finds nothing, within its horizon\n")
	:: pr == P_BLIND -> printf("it finds nothing, past its horizon\n")
	fi
}

#define NATIVE_FRESH (has_native && sent_age < TTL - MARGIN)

/* nothing local survives a request */
inline forget() {
	act = 0; why = 0; a = 0; earlier = 0; out = 0; oid = 0; pr = 0; caught_up = 0
}

/* The client is given its final answer (2xx, or a 4xx refusal) and stops retrying. */
inline reply(id) {
	printf("client%d is given response %d\n", h, id);
	answer(id); stopped[h] = 1
}

/* decide(record, request, now, policy) for a record that exists, at the instant it is read. Answers
 * that need no further step are given here. */
inline decide() {
	printf("gw%d reads ", h); printm(st);
	printf(" (attempt %d, lease left %d, first sent %d ago)\n", att, lease_left, sent_age);
	a = att;
	if
	:: st == completed && has_resp -> REACH(W_REPLAY); reply(resp); act = ACT_DONE
#ifdef MUTATION_PURGED_NATIVE_RESEND
	/* the old rule: a purged record is sent again under its native key while the key looks fresh */
	:: st == completed && !has_resp && NATIVE_FRESH -> act = ACT_RECLAIM; why = resend_purged
	:: st == completed && !has_resp && !NATIVE_FRESH && has_probe -> act = ACT_PURGED
	:: st == completed && !has_resp && !NATIVE_FRESH && !has_probe ->
#else
	:: st == completed && !has_resp && has_probe -> act = ACT_PURGED
	:: st == completed && !has_resp && !has_probe ->
#endif
		REACH(W_PURGED_GONE); printf("client%d: 410 response-purged\n", h);
		stopped[h] = 1; act = ACT_DONE
	:: (st == pending || st == in_doubt) && lease_left > 0 -> act = ACT_DONE         /* 409 */
	:: (st == pending || st == in_doubt) && lease_left == 0 ->
		/* DESIGN.md's recovery order; a pending record whose lease ran out may have been sent */
		act = ACT_RECLAIM;
		if
		:: !(mhs || st == pending) -> why = resend_never_sent
		:: else ->
			if
			:: NATIVE_FRESH -> why = resend_native_key
			:: else ->
				if
				:: has_probe -> why = send_probe_not_found
				:: else ->
					if
					:: is_harmless -> why = resend_harmless
					:: else -> act = ACT_REVIEW
					fi
				fi
			fi
		fi
	:: st == retryable -> act = ACT_RECLAIM; why = resend_retryable
	:: st == needs_review -> act = ACT_DONE                                           /* 409 */
	fi;
	if
	:: act == ACT_DONE -> forget()
	:: else -> skip
	fi
}

/* A gateway crashes: its local state is gone; its store writes and the request it sent are not. */
#define CRASH \
	d_step { \
		crashes < MAXCRASH -> crashes++; printf("gw%d CRASHES\n", h); \
		dl[h] = NODL; waiting[h] = 0; ans[h] = 0; ansid[h] = 0; forget() \
	}; \
	goto next

/* The re-claim takes the record over for a new attempt. It is fenced by the attempt, and it re-checks
 * what decide() saw, at the database's now: the holder of the same attempt may have settled the record
 * since (the attempt alone does not show that) or renewed its lease, and the key may have aged. */
#ifndef FINDING_RECLAIM_FENCED_BY_ATTEMPT_ONLY
#define STILL_AS_DECIDED ( \
	(why == resend_retryable && st == retryable) || \
	(why != resend_retryable && (st == pending || st == in_doubt) && lease_left == 0 && \
	 (why != resend_never_sent || !mhs)))
#else
#define STILL_AS_DECIDED 1
#endif
#ifndef FINDING_JUDGE_AT_READ
#define KEY_STILL_FRESH (why != resend_native_key || NATIVE_FRESH)
#else
#define KEY_STILL_FRESH 1
#endif

proctype Client(byte h) {
	byte n;                     /* requests made */
	byte act;                   /* what decide() said */
	mtype why;                  /* why a request is sent */
	byte a;                     /* the attempt read, then the attempt held */
	bool earlier;               /* may_have_sent when the attempt was taken: doubt is sticky */
#ifdef MUTATION_HORIZON_AT_CLAIM
	bool young;                 /* the record was within the probe's horizon at the re-claim */
#endif
	byte out, oid, pr;          /* what came back, a response id, the probe's answer (then a state) */
	bool caught_up;             /* at the probe's re-claim: the search has had its lag since the latest attempt */

next:
	skip;
	/* claim: insert a pending record holding attempt 1, or read the one that holds the key, and decide */
	if
	:: d_step {
		n < REQUESTS && !stopped[h] -> n++;
		if
		:: st == nothing ->
			printf("gw%d claims: attempt 1\n", h);
			set_state(pending); att = 1; mhs = 0; lease_left = LEASE; sent_age = 0; lag_left = SENT_LAG;
			act = ACT_SEND; a = 1; earlier = 0; why = first_try; dl[h] = GRACE
		:: else -> decide()
		fi
	   }
	:: d_step { n >= REQUESTS || stopped[h] -> finished++ }; goto done
	fi;
	if
	:: act == ACT_SEND -> goto sending
	:: act == ACT_RECLAIM -> goto reclaim
	:: act == ACT_REVIEW -> goto review
	:: act == ACT_PURGED -> goto purged
	:: act == 0 -> goto next
	fi;

review:	/* send_to_review: fenced; it keeps the attempt number, and its holder, should it wake up, is
	   fenced out by the state (each of its writes is fenced on pending: HOLDS) */
	skip;
	d_step {
		if
		:: att == a && (st == pending || st == in_doubt) && lease_left == 0 ->
			REACH(W_REVIEW); printf("gw%d sends it to review\n", h);
			set_state(needs_review)
		:: else -> skip
		fi;
		forget()                                                    /* 409 outcome-unknown */
	}
	goto next;

reclaim:
	skip;
	d_step {
		if
		:: att == a && STILL_AS_DECIDED && KEY_STILL_FRESH && why != resend_purged ->
			if :: st == pending -> REACH(W_TAKEN_OVER) :: else -> skip fi;
			if :: why == resend_native_key -> REACH(W_NATIVE_RESEND) :: else -> skip fi;
			printf("gw%d re-claims (", h); printm(why); printf("): attempt %d\n", att + 1);
			mhs = mhs || st == pending; set_state(pending); att++; lease_left = LEASE;
			a = att; earlier = mhs; dl[h] = GRACE;
			if    /* a re-claim to probe keeps the send times; one to send is a send */
			:: why == send_probe_not_found -> caught_up = (lag_left == 0)
			:: else -> lag_left = SENT_LAG
			fi;
#ifdef MUTATION_HORIZON_AT_CLAIM
			young = sent_age < HORIZON;
#endif
			skip
		:: att == a && KEY_STILL_FRESH && why == resend_purged ->
			earlier = 1              /* (mutation only) sent under the completed record's attempt, no lease */
		:: else ->
			if :: att == a && !STILL_AS_DECIDED -> REACH(W_RECLAIM_REFUSED) :: else -> skip fi;
			if :: att == a && STILL_AS_DECIDED && !KEY_STILL_FRESH -> REACH(W_KEY_STALE_AT_RECLAIM) :: else -> skip fi;
			printf("gw%d: the re-claim finds the record changed (409)\n", h);
			forget()
		fi
	}
	if
	:: act == 0 -> goto next
	:: act != 0 && why == send_probe_not_found -> goto probing
	:: act != 0 && why != send_probe_not_found -> goto sending
	fi;

probing:	/* ask the upstream whether the effect exists, under the lease just taken */
	if
	:: atomic {
		probe(); dl[h] = NODL;
#ifdef FINDING_PROBE_SEND_SAME_LEASE
		if :: pr == P_NOTFOUND -> dl[h] = GRACE :: else -> skip fi;   /* it sends within the grace of its probe */
#endif
		printf("gw%d probes: ", h); say_probe()
	   }
	:: CRASH
	fi;
	d_step {
		if
		:: pr == P_FOUND ->
			if
			:: HOLDS(a) ->
				REACH(W_PROBE_FOUND);
				set_state(completed); mhs = 1; has_resp = 1; resp = oid; lease_left = 0; reply(oid)
			:: else -> REACH(W_FENCED_OUT); printf("gw%d is fenced out\n", h)
			fi;
			forget()
		:: pr == P_FAIL ->                                       /* back to in doubt, as it was: 503 */
			if
			:: HOLDS(a) -> REACH(W_PROBE_FAILED); set_state(in_doubt); mhs = 1; lease_left = 0
			:: else -> skip
			fi;
			forget()
		:: (pr == P_NOTFOUND || pr == P_BLIND) && !TRUSTED ->   /* too soon to tell: as it was, 503 */
			if
			:: HOLDS(a) -> REACH(W_PROBE_TOO_SOON); set_state(in_doubt); mhs = 1; lease_left = 0
			:: else -> skip
			fi;
			dl[h] = NODL; forget()
		:: pr == P_BLIND && TRUSTED ->                           /* needs_review: 409 outcome-unknown */
			if
			:: HOLDS(a) -> REACH(W_PROBE_BLIND); set_state(needs_review); lease_left = 0
			:: else -> skip
			fi;
			forget()
		:: pr == P_NOTFOUND && TRUSTED ->
#ifndef FINDING_PROBE_SEND_SAME_LEASE
			/* the probe used up part of the lease: a fresh one for the send (fenced), a send */
			if
			:: HOLDS(a) -> REACH(W_PROBE_NOT_FOUND); lease_left = LEASE; dl[h] = GRACE; lag_left = SENT_LAG
			:: else -> forget()
			fi
#else
			skip                          /* sends under the probe's lease */
#endif
		fi
	}
	if
	:: act == 0 -> goto next
	:: else -> goto sending
	fi;

purged:	/* completed, its response dropped after the retention: nothing is ever sent again */
	skip;
	atomic {
		probe();
		printf("gw%d probes for the purged response: ", h); say_probe();
		if
		:: pr == P_FOUND ->                   /* the probe supplies the answer, and the store keeps it */
			if
			:: att == a && st == completed -> REACH(W_PURGED_FOUND); has_resp = 1; resp = oid
			:: else -> skip
			fi;
			reply(oid); forget()
		:: pr == P_NOTFOUND || pr == P_BLIND ->
#ifdef MUTATION_PURGED_RESEND
			earlier = 1; why = resend_purged      /* the old rule: not found, so send it again */
#else
			REACH(W_PURGED_GONE); printf("client%d: 410 response-purged\n", h);
			stopped[h] = 1; forget()
#endif
		:: pr == P_FAIL ->                                       /* 503 while the probe fails */
#ifdef MUTATION_FAILED_PROBE_DOUBT
			if                                    /* the old bug: the failed probe leaves it in doubt */
			:: att == a -> set_state(in_doubt); mhs = 1
			:: else -> skip
			fi;
#endif
			forget()
		fi
	}
	if
	:: act == 0 -> goto next
	:: else -> goto sending
	fi;

sending:	/* the request leaves, or the connection is refused before it does */
	if
	:: d_step { out = A_NOTSENT; dl[h] = NODL; printf("gw%d: connection refused, nothing sent\n", h) }
	:: d_step {
#ifdef STRUCTURAL
		/* the leases keep requests for one key in single file: none leaves while another may land */
		CHECK(!infl[0] && !infl[1], "VIOLATED: two requests for the key in flight at once\n");
#endif
		if
		:: !infl[0] -> oid = 0
		:: else -> CHECK(!infl[1], "VIOLATED (model bound): more requests in flight than SLOTS\n"); oid = 1
		fi;
		infl[oid] = 1; sdl[oid] = TIMEOUT - 1; sowner[oid] = h; sreason[oid] = why;
		waiting[h] = oid + 1; ans[h] = A_NONE; ansid[h] = 0; dl[h] = NODL; oid = 0;
		printf("gw%d sends (attempt %d, ", h, a); printm(why); printf(")\n")
	   }
		/* its answer; or none: a timeout or reset, possibly while the request is still on its way */
		if
		:: d_step { ans[h] != A_NONE -> out = ans[h]; oid = ansid[h]; waiting[h] = 0; ans[h] = 0; ansid[h] = 0 }
		:: d_step { ans[h] == A_NONE -> out = A_NONE; waiting[h] = 0; printf("gw%d: no answer (timeout or reset)\n", h) }
		fi
	:: CRASH
	fi;

	/* settle(outcome, earlier_doubt): the fenced write of what this attempt saw, and the reply */
	if
	:: d_step {
		if
		:: out == A_OK -> pr = completed
		:: out == A_4XX -> pr = completed; oid = REJECTED
		:: out == A_5XX || out == A_NONE -> pr = in_doubt
		:: out == A_NOTSENT -> pr = retryable
		fi;
#ifndef MUTATION_DOUBT_NOT_STICKY
		if
		:: pr == retryable && earlier -> REACH(W_STICKY); pr = in_doubt      /* doubt is sticky */
		:: else -> skip
		fi;
#endif
		if
#ifndef MUTATION_NO_FENCE
		:: HOLDS(a) ->
#else
		:: true ->
#endif
			printf("gw%d settles attempt %d\n", h, a);
			set_state(pr);
			mhs = earlier || out != A_NOTSENT;
			if
			:: out != A_NONE -> lease_left = 0          /* it answered (or never left): its lease is over */
			:: else -> skip
			fi;
#ifndef MUTATION_LAG_FROM_CLAIM
			if    /* its answer recorded: it acted before now, and the search lists it LAG from now */
			:: out == A_OK || out == A_4XX || out == A_5XX -> lag_left = LAG
			:: else -> skip
			fi;
#endif
			if
			:: pr == completed ->
				if :: out == A_4XX -> REACH(W_REFUSED_4XX) :: else -> skip fi;
				has_resp = 1; resp = oid; reply(oid)
			:: else -> skip
			fi
		:: else -> REACH(W_FENCED_OUT); printf("gw%d is fenced out (attempt %d)\n", h, a)   /* 409 */
		fi;
		forget()
	   }
	:: CRASH
	fi;
	goto next;

done:
	skip
}

init {
	d_step {
		transition_table();
		dl[0] = NODL; dl[1] = NODL
	}
	atomic {
#ifdef KIND
		kind = KIND;
#else
		if    /* the richest kind first: a depth-first search that stops at an error gets there soonest */
		:: kind = K_BOTH
		:: kind = K_NATIVE
		:: kind = K_PROBE
		:: kind = K_NEITHER
		:: kind = K_HARMLESS
		fi;
#endif
		run Client(0);
		run Client(1)
	}
}
