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

The cycle itself (decoding.py, tree.py) holds no clock and prints nothing: it returns the ids and
each cycle's tau. What --show, --show-svg, --bench and the streamed text need more, this file gets
from outside, by wrapping the cycle's steps while one decoding runs (`wrapped`): a Watcher rebuilds
each cycle (a Cycle) from the steps' results as it commits, a PhaseClock sums each phase's time.
"""

import contextlib
import functools
import time
from dataclasses import dataclass, field

import torch

import decoding
import tree
from support.common import DTYPES, dtype_name


# ------------------------------------------------------------------------------- run a decoding
def speculate(target, draft, prompt_ids, max_new_tokens, shape, *, watch=None, phases=False, **kw):
    """Speculative decoding as the scripts run it: a verify shape, ("path", k) or ("tree", n) ->
    (ids [1, P + n], Stats). watch(Cycle) sees each cycle as it commits (--show, the streamed text);
    phases: time each phase too (--show, --bench; on a GPU a synchronize around every step). kw:
    speculative_generate's (use_selector, temperature, generator, stop_ids, head). head: what
    scores the draft's rows, the target's head when None; a caller that ran the draft through
    speed/ passes the one speed/ gave it (speed.machine.draft_head)."""
    kind, n = shape
    loop = decoding.speculative_generate if kind == "path" else tree.tree_generate
    decode = lambda: loop(target, draft, prompt_ids, max_new_tokens, n, **kw)  # noqa: E731
    watcher = Watcher(watch) if watch else None
    with wrapped(watcher.wrap) if watcher else contextlib.nullcontext():
        return timed(decode, prompt_ids, draft.config.block_size, phases)


def label(shape) -> str:
    kind, n = shape
    return f"path of {n} draft{'s' * (n > 1)}" if kind == "path" else f"tree of {n} nodes"


# ---------------------------------------------------------------------------- statistics and timing
@dataclass
class Stats:
    new_tokens: int = 0
    seconds: float = 0.0  # wall clock of the whole call, prefill included
    # acceptance length per cycle: accepted drafts + 1, in 1..B
    taus: list = field(default_factory=list)
    # [j-1]: in how many cycles draft slot j was accepted
    accepted_at: list = None
    draft_s: float = 0.0  # wall clock per phase, summed over the cycles (when timed)
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
        s = (
            f"{s}; {n} cycles, mean acceptance length {self.mean_tau:.2f}\n"
            f"  acceptance rate by block position 1..{len(self.accepted_at)}: {rate}"
        )
        if not phases:  # the phases were not timed
            return s
        split = " / ".join(
            f"{name} {100 * t / phases:.0f}%"
            for name, t in (
                ("draft", self.draft_s),
                ("selector", self.select_s),
                ("verify", self.verify_s),
            )
        )
        return f"{s}\n  cycle time (wall clock per phase): {split}"


def timed(decode, prompt_ids, block_size=None, phases=False):
    """Run decode() -> (ids [1, P + n], taus) -> (ids, Stats). block_size: the draft's B for a
    speculative decoding (acceptance by slot); None for plain decoding, whose Stats hold its tokens
    and time only. phases: a PhaseClock times the cycle's phases too. Without it nothing is
    synchronized: every cycle reads its tokens back (.tolist()), which waits for the device."""
    clock = PhaseClock(prompt_ids.device) if phases else None
    with (
        clock or contextlib.nullcontext(),
        wrapped(clock.wrap) if clock else contextlib.nullcontext(),
    ):
        start = time.perf_counter()
        ids, taus = decode()
        total = time.perf_counter() - start
    total = clock.total if clock else total
    n = ids.shape[1] - prompt_ids.shape[1]
    if block_size is None:
        return ids, Stats(new_tokens=n, seconds=total)
    # slot j accepted iff tau > j
    accepted_at = [sum(t > j for t in taus) for j in range(1, block_size)]
    s = clock.seconds if clock else dict.fromkeys(("draft", "selector", "verify"), 0.0)
    return ids, Stats(n, total, taus, accepted_at, s["draft"], s["selector"], s["verify"])


# ------------------------------------------------------------------ the cycle's steps, from outside
# the steps of decoding.py and tree.py a wrapper sees, the phase each counts in (commit: none)
PHASES = {
    "prefill": "prefill",
    "draft_scores": "draft",
    "extend_context": "draft",
    "draft_proposal": "selector",
    "draft_tree": "selector",
    "target_forward": "verify",
    "accept": "verify",
    "attention_masks": "verify",
    "follow_target": "verify",
    "keep_rows": "verify",
    "commit": None,
}


@contextlib.contextmanager
def wrapped(wrap):
    """While the block runs, each step `name` of the cycle is wrap(name, step): in decoding.py and
    in tree.py, which calls decoding's steps by the names it imported."""
    steps = [
        (m, name, getattr(m, name)) for m in (decoding, tree) for name in PHASES if hasattr(m, name)
    ]
    try:
        for m, name, step in steps:
            setattr(m, name, wrap(name, step))
        yield
    finally:
        for m, name, step in steps:
            setattr(m, name, step)


class PhaseClock:
    """Wall clock per phase of the cycle while it runs (`with PhaseClock(device) as clock:`, its
    wrap around the steps): each step adds its time to clock.seconds[its phase]; clock.total is the
    whole span. A step called inside another timed step counts in the outer one's phase."""

    def __init__(self, device):
        self.device, self.busy, self.total = device, False, 0.0
        self.seconds = {"prefill": 0.0, "draft": 0.0, "selector": 0.0, "verify": 0.0}

    def __enter__(self):
        self.start = now(self.device)
        return self

    def __exit__(self, *exc):
        self.total = now(self.device) - self.start

    def wrap(self, name: str, step):
        phase = PHASES[name]
        if phase is None:
            return step

        @functools.wraps(step)
        def timed_step(*args, **kwargs):
            if self.busy:
                return step(*args, **kwargs)
            self.busy, start = True, now(self.device)
            try:
                return step(*args, **kwargs)
            finally:
                self.seconds[phase] += now(self.device) - start
                self.busy = False

        return timed_step


def now(device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()  # CUDA runs asynchronously: time the work, not the kernel launches
    return time.perf_counter()


# ----------------------------------------------------------------------------- watching each cycle
@dataclass
class Cycle:
    """What a watcher sees of one cycle: the tokens it committed (`new`, cut at a stop token or at
    max_new_tokens); the drafts it sent (a path's d_1..d_k, or a tree's nodes), the unary argmax of
    each one's slot, how many the target accepted, its bonus token; for a tree, the tree and its
    accepted nodes. The prefill's token comes as a Cycle with `new` only."""

    new: list
    drafts: list = None
    unary: list = None
    accepted: int = 0
    bonus: int = None
    tree: object = None
    path: list = None


def unary_best(u) -> list:
    """The unary argmax of each scored slot, u [1, L, V] -> [L]: a plain DFlash path's drafts."""
    return u[0].argmax(-1).tolist()


class Watcher:
    """Wrapped around the cycle's steps (its wrap), keeps what each returned and, at every commit,
    hands watch the cycle it makes up (a Cycle)."""

    def __init__(self, watch):
        self.watch, self.seen = watch, {}

    def wrap(self, name: str, step):
        @functools.wraps(step)
        def seen(*args, **kwargs):
            out = step(*args, **kwargs)
            if name == "commit":  # commit(ids, new, ...) -> (ids, done)
                self.committed(args[0], out[0])
            else:
                self.seen[name] = out
            return out

        return seen

    def committed(self, before, after):
        new, got, self.seen = after[0, before.shape[1] :].tolist(), self.seen, {}
        if "draft_scores" not in got:  # the prefill's token
            return self.watch(Cycle(new))
        best = unary_best(got["draft_scores"][1])
        if "draft_tree" in got:
            t, (path, bonus) = got["draft_tree"], got["follow_target"]
            unary = [best[d - 1] for d in t.depths[1:]]  # the unary argmax of each node's slot
            return self.watch(Cycle(new, t.tokens[1:], unary, len(path), bonus, tree=t, path=path))
        (d, _), (a, bonus) = got["draft_proposal"], got["accept"]
        return self.watch(Cycle(new, d[0].tolist(), best, a, bonus))


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


def path_kinds(n: int, accepted: int) -> list:
    """The kinds of a path's n drafts, the first `accepted` of them accepted: accepted, then the
    first rejected one, then those never checked (--show and --show-svg alike)."""
    return (["accepted"] * accepted + ["rejected"] + ["unchecked"] * n)[:n]


def branches(t, path) -> list:
    """The nodes of a tree t's accepted path that are not their parent's best child (its first in
    best-first order): where a path would have stopped and the tree went on, --show's `*`."""
    first = {}  # each parent's best child
    for i in range(len(t.parents) - 1, 0, -1):
        first[t.parents[i]] = i
    return [i for i in path if first[t.parents[i]] != i]


def format_block(drafts, unary, accepted: int, bonus: int, text, color=False) -> str:
    """One cycle as one line: drafts d_1..d_{B-1} [B-1], the first `accepted` of them accepted, the
    next one rejected, the rest never checked, then the target's bonus token; a `*` marks a draft
    that is not the unary argmax of its slot (unary [B-1]). text(id) -> the token's text."""
    kinds = path_kinds(len(drafts), accepted)
    slots = [mark(text(d), kind, color, d != u) for d, u, kind in zip(drafts, unary, kinds)]
    return " ".join(slots + [mark(text(bonus), "bonus", color)])


def format_tree(t, path, bonus: int, text, color=False) -> str:
    """One tree cycle as one line: a tree.Tree t (node 0 the anchor, best child first), its accepted
    nodes `path`, the target's bonus token; then its size and width by depth."""
    last, departs = (path[-1] if path else 0), branches(t, path)
    rejected = [text(t.tokens[i]) for i in range(1, len(t.tokens)) if t.parents[i] == last]
    slots = [mark(text(t.tokens[i]), "accepted", color, i in departs) for i in path]
    slots += [mark("|".join(rejected), "rejected", color)] if rejected else []
    width = " ".join(str(t.depths.count(d)) for d in range(1, max(t.depths) + 1))
    return (
        " ".join(slots + [mark(text(bonus), "bonus", color)])
        + f"   {len(t.tokens) - 1} nodes, by depth {width}"
    )


def token_text(tok, t: int) -> str:
    """A token as --show writes it: its text, newlines and tabs shown escaped."""
    return repr(tok.decode([t]))[1:-1]


class ShowBlocks:
    """The watcher of --show: prints each cycle (a Cycle) as `cycle  tau  block`."""

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
            else format_tree(cycle.tree, cycle.path, bonus, text, self.color)
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


# ---------------------------------------------------------- --compare: the speed-up, a tie or a bug
REPEATS = 5  # --compare's speed-up: the median of this many decodings each way


def median_speedup(speculative, plain, repeats: int = REPEATS) -> str:
    """speculative(), plain() -> the Stats of one decoding each. Both run `repeats` times in turn
    (a shared machine that speeds up or slows down meanwhile does so for both) -> the line saying
    the ratio of their median tok/s, and that it is one: one decoding of a few dozen tokens
    scatters by tens of percent."""
    spec, base = [], []
    for _ in range(repeats):
        spec.append(speculative().tok_per_s)
        base.append(plain().tok_per_s)
    s, b = sorted(spec)[repeats // 2], sorted(base)[repeats // 2]
    return (
        f"speedup {s / b:.2f}x (median of {repeats} runs each way: {s:.1f} against {b:.1f} tok/s)"
    )


# At temperature 0 speculative output is the target's greedy output, but "the target's" is up to
# rounding: a verify of n tokens and a one-token step run differently shaped GEMMs, which round
# differently (the SmolLM2 target, the same positions both ways: logits up to 5e-5 apart in fp32,
# 0.7 in bf16). Where its top two tokens are closer than that, either side may win.
def compare(target, P: int, plain, spec, temperature: float, block_size: int) -> str:
    """--compare's verdict on two decodings of one prompt [1, P]: identical, or where they part
    and whether that is a numerics tie or a bug."""
    if torch.equal(plain, spec):
        return "identical"
    if temperature > 0:
        return "different (expected only at temperature > 0)"
    n = min(plain.shape[1], spec.shape[1])
    i = next((j for j in range(P, n) if plain[0, j] != spec[0, j]), n)
    if i == n:  # one stopped where the other went on: no token to weigh
        return f"different at token {i - P + 1}: NOT a tie: a bug (one output is cut short)"
    step, block = logits_two_ways(target, plain[:, :i], block_size)
    dtype = dtype_name(next(target.parameters()).dtype)
    tie, a, b = numerics_tie(step, block, int(plain[0, i]), int(spec[0, i]), dtype)
    at = f"different at token {i - P + 1}"
    if tie:
        return f"{at}: a numerics tie (top-2 logits {a:.6g}, {b:.6g} within {dtype} rounding)"
    return f"{at}: NOT a tie: a bug (logits {a:.6g}, {b:.6g}: further apart than {dtype} rounding)"


@torch.no_grad()
def logits_two_ways(target, prefix, m: int):
    """The target's logits [V] after prefix [1, L], computed twice: as a one-token step after
    L - 1 cached tokens (as plain decoding does) and as the last row of an m-token block after
    L - m (as a verify does) -> (step, block), fp32."""
    rows = []
    for n in (1, min(m, prefix.shape[1] - 1)):
        cache = decoding.new_cache(target)
        target(input_ids=prefix[:, :-n], **decoding.with_cache(target, cache))
        logits = target(input_ids=prefix[:, -n:], **decoding.with_cache(target, cache)).logits
        rows.append(logits[0, -1])
    return rows[0].float(), rows[1].float()


def numerics_tie(step, block, plain_token: int, spec_token: int, dtype: str):
    """Whether two greedy decodings that part here, plain at plain_token and speculation at
    spec_token, part on a numerics tie -> (tie, a, b), a and b the step's logits of the two tokens.

    step, block [V]: the target's logits at this position as a one-token step and as a verify's
    row (logits_two_ways). Each token's logit may move by up to the largest difference between
    the two, and by one rounding of itself in the target's dtype; a tie is two logits that close."""
    a, b = float(step[plain_token]), float(step[spec_token])
    noise = float((step - block).abs().max())
    rounding = torch.finfo(DTYPES[dtype]).eps * max(abs(a), abs(b))
    return abs(a - b) <= 2 * noise + rounding, a, b
