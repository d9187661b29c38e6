"""Watching it speculate (generate.py --show): every cycle's block as one line; else the text
streamed.

    [accepted] [accepted]* {first rejected} (never checked) (never checked) <bonus>

The draft proposed d_1..d_{B-1}; the target accepted the first a of them, rejected d_{a+1} (the
later ones were never compared), and added its own bonus token. A `*` marks a slot where the
proposal is not the unary argmax: there the selector's path (or sampling) departed from the plain
DFlash choice. A tree (--tree-budget) shows its accepted branch, then the children the target
rejected after it:

    [accepted] [accepted]* {rejected|rejected} <bonus>   16 nodes, by depth 4 5 3 2 1 1

where `*` marks an accepted node that is not its parent's best child: a path would have stopped
there, the tree went on. On a terminal colours replace the brackets.
"""

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


class ShowBlocks:
    """The on_cycle hook of --show: prints each cycle as `cycle  tau  block` (or tree)."""

    def __init__(self, tok, color: bool, tree=False):
        self.tok, self.color, self.cycles = tok, color, 0
        print(show_legend(color, tree))

    def __call__(self, drafts, unary, accepted, bonus, tree=None):
        self.cycles += 1
        text = lambda t: repr(self.tok.decode([t]))[1:-1]  # newlines and tabs shown escaped
        line = (
            format_block(drafts, unary, accepted, bonus, text, self.color)
            if tree is None
            else format_tree(tree[0].tokens, tree[0].parents, tree[1], bonus, text, self.color)
        )
        print(f"{self.cycles:4d}  tau {accepted + 1}  {line}", flush=True)


class Printer:
    """Streams committed tokens as text: decode everything so far, print only the new characters."""

    def __init__(self, tok):
        self.tok, self.ids, self.shown = tok, [], 0

    def __call__(self, new):
        self.ids += new
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        # else half a multi-byte character: wait for the rest
        if not text.endswith("\ufffd"):
            print(text[self.shown :], end="", flush=True)
            self.shown = len(text)
