"""Watching it decode: the statistics and the clock of a decoding, and what generate.py prints of it
(--show: every cycle's block as one line; else the text streamed; --show-svg; --compare).

    [accepted] [accepted]* {first rejected} (never checked) (never checked) <bonus>
    [accepted]{rejected} {rejected}[accepted]* {rejected|rejected} <bonus>   7 nodes, by depth 2 3 2

A path, then a tree (--tree-budget) depth by depth, best first; `*`: a draft that is not its slot's
unary argmax, a tree's accepted node that is not its parent's best child. The cycle (decoding.py,
tree.py) prints nothing: a Watcher rebuilds each cycle from its `watch(phase, **made)` calls.
"""

import itertools
import os
import sys
import time
from dataclasses import dataclass, field

import torch

import decoding
import tree
from support import draw
from support.common import DTYPES, UsageError, dtype_name
from support.draw import BRANCHES, DEPARTS, SHOW_KINDS, branches, path_slots, tree_kinds


# ------------------------------------------------------------------------------- run a decoding
def speculate(target, draft, prompt_ids, max_new_tokens, shape, *, watch=None, **kw):
    """Speculative decoding in a verify shape, ("path", k) or ("tree", n) -> (ids [1, P + n],
    Stats); watch(Cycle) sees each cycle as it commits; kw: the cycle's own arguments."""
    kind, n = shape
    loop = decoding.speculative_generate if kind == "path" else tree.tree_generate
    see = Watcher(watch, prompt_ids.shape[1]) if watch else None
    run = lambda: loop(target, draft, prompt_ids, max_new_tokens, n, watch=see, **kw)
    return timed(run, prompt_ids, draft.config.block_size)


def label(shape) -> str:
    kind, n = shape
    return f"path of {n} draft{'s' * (n > 1)}" if kind == "path" else f"tree of {n} nodes"


# ---------------------------------------------------------------------------- statistics and timing
@dataclass
class Stats:
    new_tokens: int = 0
    seconds: float = 0.0  # wall clock of the whole call, prefill included
    taus: list = field(default_factory=list)  # per cycle: accepted drafts + 1, in 1..B
    accepted_at: list = None  # [j-1]: in how many cycles draft slot j was accepted

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
        n = len(self.taus)
        rate = " ".join(f"{k / n:.2f}" for k in self.accepted_at)
        return (
            f"{s}; {n} cycles, mean acceptance length {self.mean_tau:.2f}\n"
            f"  acceptance rate by block position 1..{len(self.accepted_at)}: {rate}"
        )


def timed(decode, prompt_ids, block_size=None):
    """Run decode() -> (ids [1, P + n], taus) -> (ids, Stats); block_size None: plain decoding. No
    synchronize: every cycle reads its tokens back (.tolist()), which waits for the device."""
    start = time.perf_counter()
    ids, taus = decode()
    seconds = time.perf_counter() - start
    return ids, statistics(ids.shape[1] - prompt_ids.shape[1], seconds, taus, block_size)


def statistics(new_tokens: int, seconds: float, taus, block_size=None) -> Stats:
    """The Stats of a decoding that committed new_tokens in seconds; the rest as timed's."""
    if block_size is None:
        return Stats(new_tokens=new_tokens, seconds=seconds)
    accepted_at = [sum(t > j for t in taus) for j in range(1, block_size)]  # j accepted: tau > j
    return Stats(new_tokens, seconds, taus, accepted_at)


# ----------------------------------------------------------------------------- watching each cycle
@dataclass
class Cycle:
    """One cycle as a watcher sees it: the tokens it committed, the drafts it sent (a tree's nodes),
    each one's slot's unary argmax, how many were accepted, the bonus; the prefill: `new` only."""

    new: list
    drafts: list = None
    unary: list = None
    accepted: int = 0
    bonus: int = None
    tree: object = None
    path: list = None


class Watcher:
    """The cycle's watch: keeps what each phase made and hands see(Cycle) each commit."""

    def __init__(self, see, P: int):
        self.see, self.length, self.made = see, P, {}

    def __call__(self, phase, **made):
        self.made.update(made)
        if phase not in ("prefill", "commit"):
            return
        got, self.made = self.made, {}
        new, self.length = got["ids"][0, self.length :].tolist(), got["ids"].shape[1]
        if phase == "prefill":  # the prefill's token
            return self.see(Cycle(new))
        best = got["u"][0].argmax(-1).tolist()  # [L] each slot's unary argmax
        if "tree" in got:
            t, path = got["tree"], got["path"]
            unary = [best[d - 1] for d in t.depths[1:]]  # the unary argmax of each node's slot
            return self.see(Cycle(new, t.tokens[1:], unary, len(path), got["bonus"], t, path))
        return self.see(Cycle(new, got["drafts"][0].tolist(), best, got["accepted"], got["bonus"]))


# -------------------------------------------------------------------- --show: every cycle's block
def mark(text: str, kind: str, color=False, departs=False) -> str:
    """text as a token of this kind, in its brackets or ANSI colour; `*` after it if it departs."""
    left, right, sgr, _ = SHOW_KINDS[kind]
    star = ("\x1b[33m*\x1b[0m" if color else "*") if departs else ""
    return (f"\x1b[{sgr}m{text}\x1b[0m" if color else f"{left}{text}{right}") + star


def format_block(drafts, unary, accepted: int, bonus: int, text, color=False) -> str:
    """One path cycle as one line: drafts [B-1] marked against unary [B-1], then the bonus."""
    slots = path_slots(drafts, unary, accepted, bonus)
    return " ".join(mark(text(d), kind, color, departs) for d, kind, departs in slots)


def format_tree(t, path, bonus: int, text, color=False) -> str:
    """One tree cycle as one line: depth by depth the checked nodes (draw.tree_kinds), the bonus,
    then the tree's size and width by depth."""
    kinds, departs, slots = tree_kinds(t, path), branches(t, path), []
    nodes = range(1, len(t.tokens))
    for d in range(1, len(path) + 2):  # the walk checks one depth past its last accepted node
        checked = [i for i in nodes if t.depths[i] == d and kinds[i] != "unchecked"]
        marks = []
        for kind, run in itertools.groupby(checked, key=kinds.__getitem__):
            run = list(run)  # the accepted node, or rejected siblings side by side
            words = "|".join(text(t.tokens[i]) for i in run)
            marks.append(mark(words, kind, color, run[0] in departs))
        slots += ["".join(marks)] if marks else []
    width = " ".join(str(t.depths.count(d)) for d in range(1, max(t.depths) + 1))
    slots.append(mark(text(bonus), "bonus", color))
    return " ".join(slots) + f"   {len(t.tokens) - 1} nodes, by depth {width}"


def token_text(tok, t: int) -> str:
    """A token as --show writes it: its text, newlines and tabs shown escaped."""
    return repr(tok.decode([t]))[1:-1]


# ------------------------------------------------------------------------ generate.py's answer
def add_flags(a):
    """generate.py's flags for what it prints of an answer; a: its ArgumentParser's add_argument."""
    a("--show", action="store_true", help="print each cycle's drafts as the target judged them")
    a("--show-svg", metavar="FILE", help="draw each cycle's drafts, marked as --show marks them")
    a("--compare", action="store_true", help="also decode plainly: the speed-up, any difference")


def check_flags(args, error):
    """Refuse what add_flags' flags do not go with; error: the ArgumentParser's."""
    if args.show and args.bench:
        error("--show prints the blocks of single answers; it does not go with --bench")
    if args.show_svg and (args.bench or args.prompt is None):
        error("--show-svg draws the blocks of one answer: give --prompt, not --bench")
    folder = os.path.dirname(os.path.abspath(args.show_svg or "."))
    if args.show_svg and not os.path.isdir(folder):  # a bad path: one line (support/common.run)
        raise UsageError(f"--show-svg {args.show_svg}: no folder {folder}")


class Answer(Watcher):
    """generate.py's answer to prompt_ids [1, P] as the cycle's watch: the text streamed, or each
    block (--show); report() then prints its statistics and draws it (--show-svg)."""

    def __init__(self, tok, prompt_ids, block_size: int, mode, shape, blocks=False, svg=None):
        self.tok, self.P, self.B = tok, prompt_ids.shape[1], block_size
        self.how, self.blocks, self.svg = f"{mode}, {label(shape)}", blocks, svg
        self.color, self.ids, self.shown = sys.stdout.isatty(), [], 0
        self.cycles = []  # --show-svg draws them once the answer is done
        if blocks:  # what the marks of the lines to come mean
            legend = (mark(meaning, kind, self.color) for kind, (*_, meaning) in SHOW_KINDS.items())
            print("  ".join([*legend, BRANCHES if shape[0] == "tree" else DEPARTS]))
        super().__init__(self.seen, self.P)
        self.start = time.perf_counter()

    def seen(self, cycle):
        self.cycles.append(cycle)
        (self.print_block if self.blocks else self.stream)(cycle)

    def print_block(self, c):
        """--show: a cycle as `cycle  tau  block`; the prefill's token (cycle 0) has none."""
        if c.drafts is None:
            return
        text, color = (lambda t: token_text(self.tok, t)), self.color
        if c.tree is None:
            line = format_block(c.drafts, c.unary, c.accepted, c.bonus, text, color)
        else:
            line = format_tree(c.tree, c.path, c.bonus, text, color)
        print(f"{len(self.cycles) - 1:4d}  tau {c.accepted + 1}  {line}", flush=True)

    def stream(self, c):
        """Decode all committed so far, print what is new."""
        self.ids += c.new
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        if not text.endswith("\ufffd"):  # else half a multi-byte character: wait for the rest
            print(text[self.shown :], end="", flush=True)
            self.shown = len(text)

    def report(self, ids, taus, messages) -> Stats:
        tok, seconds = self.tok, time.perf_counter() - self.start
        stats = statistics(ids.shape[1] - self.P, seconds, taus, self.B)
        if self.blocks:
            print(tok.decode(ids[0, self.P :], skip_special_tokens=True), end="")
        print(f"\n[{self.how}] {stats.summary()}")
        if self.svg:
            how = f"{self.how}: {len(stats.taus)} cycles"
            title = f"{how}, mean tau {stats.mean_tau:.2f}; prompt: {messages[-1]['content'][:60]}"
            draw.decoding(self.cycles, lambda t: token_text(tok, t), title).save(self.svg)
            print(f"[--show-svg] the decoding drawn: {self.svg}")
        return stats


# ---------------------------------------------------------- --compare: the speed-up, a tie or a bug
REPEATS = 5  # --compare's speed-up: the median of this many decodings each way


def versus_plain(target, prompt_ids, out, speculative, plain, gen, state, temperature, B) -> str:
    """--compare after the speculative answer `out`: plain decoding from gen, then both ways in turn
    REPEATS times, each from its first generator state (speculative's: state), so that a shared
    machine's drift hits both -> plain's statistics, the median speed-up and the verdict."""
    plain_state = gen.get_state()
    base, base_stats = timed(lambda: plain(generator=gen), prompt_ids)

    def again(decode, at, block_size=None):  # once more, its generator back where it began
        g = torch.Generator(device=gen.device).set_state(at)
        return timed(lambda: decode(generator=g), prompt_ids, block_size)[1].tok_per_s

    runs = [(again(speculative, state, B), again(plain, plain_state)) for _ in range(REPEATS)]
    s, b = (sorted(way)[REPEATS // 2] for way in zip(*runs))  # one decoding scatters by tens of %
    median = f"median of {REPEATS} runs each way: {s:.1f} against {b:.1f} tok/s"
    verdict = compare(target, prompt_ids.shape[1], base, out, temperature, B)
    return f"[plain] {base_stats.summary()}\n  speedup {s / b:.2f}x ({median}), output {verdict}"


# At temperature 0 speculative output is the target's greedy output, but "the target's" is up to
# rounding: a verify of n tokens and a one-token step run differently shaped GEMMs, which round
# differently (the SmolLM2 target, the same positions both ways: logits up to 5e-5 apart in fp32,
# 0.7 in bf16). Where its top two tokens are closer than that, either side may win.
def compare(target, P: int, plain, spec, temperature: float, block_size: int) -> str:
    """Two decodings of one prompt [1, P]: identical, or where they part, on a tie or a bug."""
    if torch.equal(plain, spec):
        return "identical"
    if temperature > 0:
        return "different (expected only at temperature > 0)"
    n = min(plain.shape[1], spec.shape[1])
    i = next((j for j in range(P, n) if plain[0, j] != spec[0, j]), n)
    at = f"different at token {i - P + 1}"
    if i == n:  # one stopped where the other went on: no token to weigh
        return f"{at}: NOT a tie: a bug (one output is cut short)"
    step, block = logits_two_ways(target, plain[:, :i], block_size)
    dtype = dtype_name(next(target.parameters()).dtype)
    tie, a, b = numerics_tie(step, block, int(plain[0, i]), int(spec[0, i]), dtype)
    if tie:
        return f"{at}: a numerics tie (top-2 logits {a:.6g}, {b:.6g} within {dtype} rounding)"
    return f"{at}: NOT a tie: a bug (logits {a:.6g}, {b:.6g}: further apart than {dtype} rounding)"


@torch.no_grad()
def logits_two_ways(target, prefix, m: int):
    """The target's logits [V] after prefix [1, L] as a one-token step (plain decoding) and as the
    last row of an m-token verify -> (step, block), fp32."""
    rows = []
    for n in (1, min(m, prefix.shape[1] - 1)):
        cache = decoding.new_cache(target)
        target(input_ids=prefix[:, :-n], **decoding.with_cache(target, cache))
        logits = target(input_ids=prefix[:, -n:], **decoding.with_cache(target, cache)).logits
        rows.append(logits[0, -1])
    return rows[0].float(), rows[1].float()


def numerics_tie(step, block, plain_token: int, spec_token: int, dtype: str):
    """Whether greedy decodings that part at plain_token / spec_token part on a tie -> (tie, a, b),
    a and b their step logits. Each may move by the largest step-block difference (logits_two_ways)
    and one rounding in the target's dtype; a tie is two logits that close."""
    a, b = float(step[plain_token]), float(step[spec_token])
    noise = float((step - block).abs().max())
    rounding = torch.finfo(DTYPES[dtype]).eps * max(abs(a), abs(b))
    return abs(a - b) <= 2 * noise + rounding, a, b
