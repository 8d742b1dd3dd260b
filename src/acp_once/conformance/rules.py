"""Where each rule a check cites is explained: its page and heading under docs/protocol/.

A report prints every reference with its location, e.g. `R19 (docs/protocol/keys.md#r19--...)`,
so a reader can look the rule up. The anchors are the ones GitHub gives the `### R19 — title`
headings; a test holds this table to the headings in docs/ and to every check's refs.
"""

from __future__ import annotations

__all__ = ["RULE_DOCS", "explain_refs", "rule_location"]

# id -> (page under docs/protocol/ without .md, anchor of its `### <id> — <title>` heading)
RULE_DOCS: dict[str, tuple[str, str]] = {
    "D3": ("keys", "d3--what--32602-carries"),
    "D4": ("keys", "d4--how-prompts-are-compared"),
    "D6": ("cancellation", "d6--a-cancel-of-one-joined-request-withdraws-them-all"),
    "D8": ("keys", "d8--a-retry-sends-no-second-user_message"),
    "D15": ("keys", "d15--a-fork-copies-history-never-keys"),
    "D17": ("sessions", "d17--a-retry-before-sessionresume-gets--32002"),
    "D23": ("initialization", "d23--version-negotiation-highest-supported-at-or-below-the-request"),
    "D21": ("jsonrpc", "d21--batches-follow-the-transports-page-not-the-typescript-sdk"),
    "D24": ("sessions", "d24--close-and-delete-of-a-missing-session-succeed"),
    "D33": (
        "cancellation",
        "d33--sessioncancel-against-a-retry-of-a-held-prompt-arrival-order-decides",
    ),
    "R4": ("keys", "r4--no-key-no-deduplication"),
    "R5": ("keys", "r5--a-key-is-a-string-of-1-to-255-characters"),
    "R6": ("keys", "r6--a-malformed-key-is-an-error-never-no-key"),
    "R7": ("keys", "r7--keys-are-case-sensitive"),
    "R19": ("keys", "r19--an-inserted-message-answer-its-id-insert-nothing"),
    "R20": ("keys", "r20--a-pending-prompt-join-it-and-share-its-outcome"),
    "R21": ("keys", "r21--a-retry-starts-no-work"),
    "R22": ("keys", "r22--an-error-leaves-the-key-unused"),
    "R23": ("keys", "r23--never-a-second-message-for-a-recorded-key"),
    "R24": ("keys", "r24--lookup-and-insertion-are-one-step"),
    "R25": ("cancellation", "r25--cancelling-any-request-of-a-key-withdraws-its-prompt"),
    "R26": ("cancellation", "r26--a-withdrawal-answers-every-request-of-the-key-with--32800"),
    "R28": ("cancellation", "r28--sessioncancel-and-sessionclose-treat-held-prompts-as-before"),
    "R29": ("keys", "r29--keys-never-leave-the-agent"),
    "R31": ("keys", "r31--user_message-updates-do-not-carry-the-key"),
    "R32": ("keys", "r32--a-key-belongs-to-one-session"),
    "R33": ("keys", "r33--a-key-is-not-tied-to-a-connection"),
    "R35": ("keys", "r35--retained-messages-the-key-survives-connections-and-restarts"),
    "R38": ("keys", "r38--store-the-key-in-the-same-step-as-the-message"),
    "R39": (
        "transports",
        "r39--stdio-memory-while-the-process-lives-the-stored-session-across-restarts",
    ),
    "R47": ("cancellation", "r47--exactly-one-answer-per-request-whatever-the-cancel"),
    "R48": ("jsonrpc", "r48--notifications-are-never-answered"),
    "R70": ("jsonrpc", "r70--a-batch-is-an-array-of-at-least-one-message"),
    "R71": ("jsonrpc", "r71--one-answer-per-request-entry-in-one-array-none-for-notifications"),
    "R72": ("jsonrpc", "r72--an-invalid-entry-gets-its-own-error-inside-the-array"),
    "R73": ("jsonrpc", "r73--entries-may-run-concurrently-the-reply-waits-for-the-last"),
    "R49": (
        "initialization",
        "r49--initialize-comes-first-and-may-be-repeated-only-until-other-requests",
    ),
    "R50": ("held-prompts", "r50--the-answer-means-inserted"),
    "R58": ("sessions", "r58--a-session-is-active-on-the-connections-that-opened-it"),
    "R60": ("sessions", "r60--sessionresume-synchronizes-replay-on-request"),
    "R61": ("sessions", "r61--sessionclose-cancels-reports-then-answers"),
    "R62": ("sessions", "r62--sessiondelete-removes-and-succeeds-for-a-missing-session"),
    "R63": ("sessions", "r63--sessionnew-makes-a-session-active-on-its-connection"),
}


def rule_location(rule: str) -> str:
    """Where `rule` is explained, e.g. `docs/protocol/keys.md#r19--...`; for an id missing from
    the table, `docs/rules.md` (the index of every rule). Never raises."""
    found = RULE_DOCS.get(rule)
    if found is None:
        return "docs/rules.md"
    page, anchor = found
    return f"docs/protocol/{page}.md#{anchor}"


def explain_refs(refs: tuple[str, ...] | list[str]) -> str:
    """`R19 (docs/protocol/keys.md#r19--...), R21 (...)`: each ref with its location."""
    return ", ".join(f"{ref} ({rule_location(ref)})" for ref in refs)
