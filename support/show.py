"""Watching it decode: the statistics and the clock of a decoding, and what generate.py prints of it
(--show: every cycle's block as one line; else the text streamed).

    [accepted] [accepted]* {first rejected} (never checked) (never checked) <bonus>

The draft proposed d_1..d_{B-1}; the target accepted the first a of them, rejected d_{a+1} (the
later ones were never compared), and added its own bonus token. A `*` marks a slot where the
proposal is not the unary argmax: there the selector's path (or sampling) departed from the plain
DFlash choice. A tree (--tree-budget) shows its accepted branch, then the children the target
rejected after it:

    [accepted] [accepted]* {rejected|rejected} <bonus>   16 nodes, by depth 4 5 3 2 1 1

where `*` marks an accepted node that is not its parent's best child: a path would have stopped
there, the tree went on. On a terminal colours replace the brackets.

The cycle itself (decoding.py, tree.py) holds no timing and prints nothing: it hands each cycle to
an optional watcher (ShowBlocks, Printer), and each of its steps names the phase it belongs to
(`@phase`), which a running PhaseClock sums.
"""

import functools
import time
from dataclasses import dataclass, field

import torch


# ---------------------------------------------------------------------------- statistics and timing
@dataclass
class Stats:
    new_tokens: int = 0
    seconds: float = 0.0  # wall clock of the whole call, prefill included
    # acceptance length per cycle: accepted drafts + 1, in 1..B
    taus: list = field(default_factory=list)
    # [j-1]: in how many cycles draft slot j was accepted
    accepted_at: list = None
    draft_s: float = 0.0  # wall clock per phase, summed over the cycles
    select_s: float = 0.0
    verify_s: float = 0.0

    @property
    def mean_tau(self):
        return sum(self.taus) / len(self.taus) if self.taus else float("nan")

    @property
    def tok_per_s(self):
        return self.new_tokens / self.seconds if self.seconds else float("nan")

    def summary(self) -> str:
        s = f"{self.new_tokens} tokens in {self.seconds:.2f} s, {self.tok_per_s:.1f} tok/s"
        if not self.taus:
            return s
        n, phases = len(self.taus), self.draft_s + self.select_s + self.verify_s
        rate = " ".join(f"{k / n:.2f}" for k in self.accepted_at)
        split = " / ".join(
            f"{name} {100 * t / phases:.0f}%"
            for name, t in (
                ("draft", self.draft_s),
                ("selector", self.select_s),
                ("verify", self.verify_s),
            )
        )
        return (
            f"{s}; {n} cycles, mean acceptance length {self.mean_tau:.2f}\n"
            f"  acceptance rate by block position 1..{len(self.accepted_at)}: {rate}\n"
            f"  cycle time (wall clock per phase): {split}"
        )


def timed(decode, prompt_ids, block_size=None):
    """Run decode() -> (ids [1, P + n], taus) under a PhaseClock -> (ids, Stats). block_size: the
    draft's B for a speculative decoding (acceptance by slot, the phase split); None for plain
    decoding, whose Stats hold its tokens and time only."""
    with PhaseClock(prompt_ids.device) as clock:
        ids, taus = decode()
    n = ids.shape[1] - prompt_ids.shape[1]
    if block_size is None:
        return ids, Stats(new_tokens=n, seconds=clock.total)
    # slot j accepted iff tau > j
    accepted_at = [sum(t > j for t in taus) for j in range(1, block_size)]
    s = clock.seconds
    return ids, Stats(n, clock.total, taus, accepted_at, s["draft"], s["selector"], s["verify"])


class PhaseClock:
    """Wall clock per phase of the cycle while it runs (`with PhaseClock(device) as clock:`): each
    step marked @phase(name) adds its time to clock.seconds[name]; clock.total is the whole span. A
    step called inside another timed step counts in the outer one's phase."""

    running = None  # the clock of the decoding under way, if one is timed

    def __init__(self, device):
        self.device, self.busy, self.total = device, False, 0.0
        self.seconds = {"prefill": 0.0, "draft": 0.0, "selector": 0.0, "verify": 0.0}

    def __enter__(self):
        PhaseClock.running, self.start = self, now(self.device)
        return self

    def __exit__(self, *exc):
        self.total, PhaseClock.running = now(self.device) - self.start, None


def phase(name: str):
    """A step of the cycle that counts in phase `name` (prefill, draft, selector or verify) while a
    PhaseClock runs; without one it is just the step."""

    def mark(step):
        @functools.wraps(step)
        def timed_step(*args, **kwargs):
            clock = PhaseClock.running
            if clock is None or clock.busy:
                return step(*args, **kwargs)
            clock.busy, start = True, now(clock.device)
            try:
                return step(*args, **kwargs)
            finally:
                clock.seconds[name] += now(clock.device) - start
                clock.busy = False

        return timed_step

    return mark


def now(device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()  # CUDA runs asynchronously: time the work, not the kernel launches
    return time.perf_counter()


# -------------------------------------------------------------------- --show: every cycle's block
SHOW_KINDS = {
    "accepted": ("[", "]", "30;42", "accepted draft"),
    "rejected": ("{", "}", "97;41", "first rejected draft"),
    "unchecked": ("(", ")", "2", "later draft, never checked"),
    # plain brackets, ANSI colour, meaning
    "bonus": ("<", ">", "30;46", "the target's bonus token"),
}
DEPARTS = (
    "*: the proposal is not the unary argmax there (the selector's path departs, or sampling did)"
)
BRANCHES = (
    "*: an accepted node that is not its parent's best child (a path would have stopped there)"
)


def mark(text: str, kind: str, color=False, departs=False) -> str:
    """text as a token of this kind: in its brackets, or in its ANSI colour on a terminal; `*` after
    it when the draft departs from the unary argmax."""
    left, right, sgr, _ = SHOW_KINDS[kind]
    star = ("\x1b[33m*\x1b[0m" if color else "*") if departs else ""
    return (f"\x1b[{sgr}m{text}\x1b[0m" if color else f"{left}{text}{right}") + star


def show_legend(color=False, tree=False) -> str:
    return (
        "  ".join(mark(meaning, kind, color) for kind, (*_, meaning) in SHOW_KINDS.items())
        + "  "
        + (BRANCHES if tree else DEPARTS)
    )


def format_block(drafts, unary, accepted: int, bonus: int, text, color=False) -> str:
    """One cycle as one line: drafts d_1..d_{B-1} [B-1], the first `accepted` of them accepted, the
    next one rejected, the rest never checked, then the target's bonus token; a `*` marks a draft
    that is not the unary argmax of its slot (unary [B-1]). text(id) -> the token's text."""
    kinds = ["accepted"] * accepted + ["rejected"] + ["unchecked"] * len(drafts)
    slots = [mark(text(d), kind, color, d != u) for d, u, kind in zip(drafts, unary, kinds)]
    return " ".join(slots + [mark(text(bonus), "bonus", color)])


def format_tree(tokens, parents, path, bonus: int, text, color=False) -> str:
    """One tree cycle as one line: a tree's nodes tokens / parents (node 0 the anchor, parents[i] <
    i, best child first), its accepted nodes `path`, the target's bonus token; then its size and
    width by depth."""
    # each parent's best child: its first in best-first order
    first = {}
    for i in range(len(tokens) - 1, 0, -1):
        first[parents[i]] = i
    last = path[-1] if path else 0
    rejected = [text(tokens[i]) for i in range(1, len(tokens)) if parents[i] == last]
    slots = [mark(text(tokens[i]), "accepted", color, first[parents[i]] != i) for i in path]
    slots += [mark("|".join(rejected), "rejected", color)] if rejected else []
    depth = [0] * len(tokens)
    for i in range(1, len(tokens)):
        depth[i] = depth[parents[i]] + 1
    width = " ".join(str(depth.count(d)) for d in range(1, max(depth) + 1))
    return (
        " ".join(slots + [mark(text(bonus), "bonus", color)])
        + f"   {len(tokens) - 1} nodes, by depth {width}"
    )


def token_text(tok, t: int) -> str:
    """A token as --show writes it: its text, newlines and tabs shown escaped."""
    return repr(tok.decode([t]))[1:-1]


class ShowBlocks:
    """The watcher of --show: prints each cycle (a decoding.Cycle) as `cycle  tau  block`."""

    def __init__(self, tok, color: bool, tree=False):
        self.tok, self.color, self.cycles = tok, color, 0
        print(show_legend(color, tree))

    def __call__(self, cycle):
        if cycle.drafts is None:  # the prefill's token: no block
            return
        self.cycles += 1
        text = lambda t: token_text(self.tok, t)
        a, bonus = cycle.accepted, cycle.bonus
        line = (
            format_block(cycle.drafts, cycle.unary, a, bonus, text, self.color)
            if cycle.tree is None
            else format_tree(
                cycle.tree.tokens, cycle.tree.parents, cycle.path, bonus, text, self.color
            )
        )
        print(f"{self.cycles:4d}  tau {a + 1}  {line}", flush=True)


class Printer:
    """The watcher that streams the text: decode everything committed so far, print only the new
    characters."""

    def __init__(self, tok):
        self.tok, self.ids, self.shown = tok, [], 0

    def __call__(self, cycle):
        self.ids += cycle.new
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        # else half a multi-byte character: wait for the rest
        if not text.endswith("\ufffd"):
            print(text[self.shown :], end="", flush=True)
            self.shown = len(text)
