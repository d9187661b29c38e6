"""Watching it speculate (generate.py --show): every cycle's block as one line.

    [accepted] [accepted]* {first rejected} (never checked) (never checked) <bonus>

The draft proposed d_1..d_{B-1}; the target accepted the first a of them, rejected d_{a+1} (the later
ones were never compared), and added its own bonus token. A `*` marks a slot where the proposal is
not the unary argmax: there the selector's path (or sampling) departed from the plain DFlash choice.
On a terminal colours replace the brackets.
"""

SHOW_KINDS = {"accepted": ("[", "]", "30;42", "accepted draft"), "rejected": ("{", "}", "97;41", "first rejected draft"),
              "unchecked": ("(", ")", "2", "later draft, never checked"),
              "bonus": ("<", ">", "30;46", "the target's bonus token")}   # plain brackets, ANSI colour, meaning
DEPARTS = "*: the proposal is not the unary argmax there (the selector's path departs, or sampling did)"


def mark(text: str, kind: str, color=False, departs=False) -> str:
    """text as a token of this kind: in its brackets, or in its ANSI colour on a terminal; `*` after it
    when the draft departs from the unary argmax."""
    left, right, sgr, _ = SHOW_KINDS[kind]
    star = ("\x1b[33m*\x1b[0m" if color else "*") if departs else ""
    return (f"\x1b[{sgr}m{text}\x1b[0m" if color else f"{left}{text}{right}") + star


def show_legend(color=False) -> str:
    return "  ".join(mark(meaning, kind, color) for kind, (*_, meaning) in SHOW_KINDS.items()) + "  " + DEPARTS


def format_block(drafts, unary, accepted: int, bonus: int, text, color=False) -> str:
    """One cycle as one line: drafts d_1..d_{B-1} [B-1], the first `accepted` of them accepted, the next
    one rejected, the rest never checked, then the target's bonus token; a `*` marks a draft that is not
    the unary argmax of its slot (unary [B-1]). text(id) -> the token's text."""
    kinds = ["accepted"] * accepted + ["rejected"] + ["unchecked"] * len(drafts)
    slots = [mark(text(d), kind, color, d != u) for d, u, kind in zip(drafts, unary, kinds)]
    return " ".join(slots + [mark(text(bonus), "bonus", color)])


class ShowBlocks:
    """The on_cycle hook of --show: prints each cycle as `cycle  tau  block`."""

    def __init__(self, tok, color: bool):
        self.tok, self.color, self.cycles = tok, color, 0
        print(show_legend(color))

    def __call__(self, drafts, unary, accepted, bonus):
        self.cycles += 1
        text = lambda t: repr(self.tok.decode([t]))[1:-1]     # newlines and tabs shown escaped
        print(f"{self.cycles:4d}  tau {accepted + 1}  {format_block(drafts, unary, accepted, bonus, text, self.color)}",
              flush=True)
