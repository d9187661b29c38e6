"""Pictures as plain SVG, laid out from what the project's functions return (it computes nothing
about the method): the mechanism (tools/figures.py), a decoding (generate.py --show-svg), the
charts of tools/plot.py. By hand: no dependency, the same bytes on every machine. A mark's class
says what it shows ("seen", "accepted", "walk"): its colour below, and what a test reads back.
"""

from xml.sax.saxutils import escape, quoteattr

CHAR = 7.3  # px: a character of the 12 px monospace font is about 0.6 of it wide
CELL = 16  # a grid cell, px
STYLE = """
text { font-family: DejaVu Sans Mono, Menlo, Consolas, monospace; font-size: 12px; fill: #222; }
text.title { font-size: 14px; font-weight: bold; }
text.note, text.tick, text.score { fill: #555; font-size: 11px; }
rect.halo { fill: #fff; opacity: 0.85; }
rect.seen { fill: #3b6fb6; } rect.unseen { fill: #f4f4f4; stroke: #ddd; }
rect.token { fill: #fff; stroke: #999; } rect.context { fill: #eef3fa; stroke: #9ab; }
rect.accepted { fill: #b7e4b0; stroke: #3a8a32; } rect.rejected { fill: #f6b3ad; stroke: #b3261e; }
rect.unchecked { fill: #eee; stroke: #bbb; stroke-dasharray: 3 2; }
rect.bonus { fill: #a9dcec; stroke: #1f7a99; } rect.anchor { fill: #fff; stroke: #333; }
rect.node { fill: #fff; stroke: #888; }
g.walk rect.node { stroke: #b3261e; stroke-width: 2; }
line { stroke: #888; } line.sep { stroke: #333; stroke-width: 1.5; }
line.tap { stroke: #3b6fb6; stroke-width: 1.5; }
line.edge { stroke: #bbb; } line.walk { stroke: #b3261e; stroke-width: 3; }
line.unary { stroke: #1f77b4; stroke-width: 2; stroke-dasharray: 6 4; }
line.accepted { stroke: #3a8a32; stroke-width: 3; } line.bonus { stroke-dasharray: 4 3; }
line.axis { stroke: #333; } line.grid { stroke: #eee; }
text.departs { fill: #c77800; font-weight: bold; }
polyline { fill: none; stroke-width: 2; } polyline.dashed { stroke-dasharray: 6 4; }
"""


def num(v) -> str:
    """A coordinate or value as short text: at most 2 decimals, no trailing zeros."""
    return f"{v:.2f}".rstrip("0").rstrip(".")


def attributes(attrs: dict) -> str:
    """Keywords as SVG attributes (class_ -> class, data_run -> data-run), None ones left out."""
    return " ".join(
        f"{k.rstrip('_').replace('_', '-')}={quoteattr(num(v) if isinstance(v, float) else str(v))}"
        for k, v in attrs.items()
        if v is not None
    )


class Svg:
    """A picture being drawn under its title: marks appended in order, its size their extent."""

    def __init__(self, title: str):
        self.items, self.width, self.height = [], 0.0, 0.0
        self.text(10, 14, title, "title")

    def add(self, tag, right, bottom, text=None, tip=None, **attrs):
        """One element reaching to (right, bottom); tip: a tooltip."""
        self.width, self.height = max(self.width, right), max(self.height, bottom)
        inner = (f"<title>{escape(tip)}</title>" if tip else "") + escape(text or "")
        head = f"{tag} {attributes(attrs)}"
        self.items.append(f"<{head}>{inner}</{tag}>" if inner else f"<{head}/>")

    def rect(self, x, y, w, h, cls, tip=None, **attrs):
        self.add("rect", x + w, y + h, tip=tip, x=x, y=y, width=w, height=h, class_=cls, **attrs)

    def text(self, x, y, s, cls=None, anchor=None, **attrs):
        """Text centred vertically on y; anchor: middle or end to centre or right-align it on x."""
        w = CHAR * len(s) * (1.25 if cls == "title" else 1.0)  # a title is larger, bold
        left = x - {"middle": w / 2, "end": w}.get(anchor, 0)
        self.width = max(self.width, left + w)
        self.add("text", x, y + 4, text=s, x=x, y=y + 4, class_=cls, text_anchor=anchor, **attrs)

    def line(self, x1, y1, x2, y2, cls=None, **attrs):
        self.add("line", max(x1, x2), max(y1, y2), x1=x1, y1=y1, x2=x2, y2=y2, class_=cls, **attrs)

    def polyline(self, points, cls, **attrs):
        text = " ".join(f"{num(x)},{num(y)}" for x, y in points)
        right, bottom = max(x for x, _ in points), max(y for _, y in points)
        self.add("polyline", right, bottom, points=text, class_=cls, **attrs)

    def label(self, x, y, s, **attrs):
        """A small score centred at (x, y) on a white ground, readable across the lines below."""
        w = CHAR * len(s) * 0.95
        self.rect(x - w / 2 - 1, y - 7, w + 2, 14, "halo")
        self.text(x, y, s, "score", "middle", **attrs)

    def circle(self, x, y, r, cls=None, **attrs):
        self.add("circle", x + r, y + r, cx=x, cy=y, r=r, class_=cls, **attrs)

    def box(self, x, y, w, h, kind, label, star=False, tip=None, **attrs):
        """A token in a box of this kind, `*` after it when star: one group, class "box KIND"."""
        self.group(f"box {kind}", **attrs)
        self.rect(x, y, w, h, kind, tip=tip)
        self.text(x + w / 2, y + h / 2, label, anchor="middle")
        if star:
            self.text(x + w + 2, y + 1, "*", "departs")
        self.end_group()

    def group(self, cls, **attrs):
        self.items.append(f"<g {attributes(dict(class_=cls, **attrs))}>")

    def end_group(self):
        self.items.append("</g>")

    def save(self, path: str):
        w, h = self.width + 10, self.height + 10
        head = (
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{num(w)}" height="{num(h)}" '
            f'viewBox="0 0 {num(w)} {num(h)}">'
        )
        white = '<rect width="100%" height="100%" fill="#fff"/>'
        body = "\n".join([head, f"<style>{STYLE}</style>", white, *self.items, "</svg>\n"])
        with open(path, "w") as f:
            f.write(body)


# ----------------------------------------------------------------------------- the mechanism
def blocks(row, loss_mask, q_pos, q_block, B: int, masks: dict) -> Svg:
    """The anchored blocks under the training row [S] (q_pos, q_block [Q]: model.anchored_blocks'),
    then each mask {name: [Q][S + Q] bool} (attention.block_attention_mask) as a grid of cells."""
    title = f"Anchored blocks: B = {B}, anchors {sorted(set(q_pos[::B]))}"
    svg, S, Q, x0 = Svg(title), len(row), len(q_pos), 110
    for y, name in ((40, "position"), (58, "row x"), (76, "loss_mask")):
        svg.text(10, y, name)
    for p in range(S):
        x = x0 + p * 2 * CELL
        svg.text(x + CELL, 40, str(p), anchor="middle")
        svg.rect(x, 48, 2 * CELL, 18, "context" if loss_mask[p] else "token")
        svg.text(x + CELL, 58, str(row[p]), anchor="middle")
        svg.text(x + CELL, 76, str(loss_mask[p]), "note", "middle")
    names = [f"x{q_pos[i]}" if i % B == 0 else "M" for i in range(Q)]
    for i in range(Q):  # each block sits under the positions its queries have
        b, y = q_block[i], 92 + q_block[i] * 22
        x = x0 + q_pos[i] * 2 * CELL
        kind = "anchor" if i % B == 0 else "node"
        svg.rect(x + 1, y, 2 * CELL - 2, 18, kind, data_block=b, data_pos=q_pos[i])
        svg.text(x + CELL, y + 10, names[i], anchor="middle")
        if i % B == 0:
            svg.text(10, y + 10, f"block {b}")
    y = 92 + (max(q_block) + 1) * 22 + 30
    rows = [f"b{q_block[i]} s{i % B} pos {q_pos[i]}" for i in range(Q)]
    cols = [str(p) for p in range(S)] + names
    splits = [S] + [S + b * B for b in range(1, Q // B)]
    for name, mask in masks.items():
        svg.text(10, y, f"{name}: query row i (a block slot) may read key j", "title")
        y = grid(svg, x0, y + 16, mask, rows, cols, splits, name) + 30
    svg.text(
        10, y - 10, "keys 0..S-1: the target's features of the row; then the block rows", "note"
    )
    return svg


def grid(svg, x0, y0, cells, rows, cols, splits, name) -> float:
    """cells [R][C] bool as squares (seen / unseen), a gap before each split -> the y below."""
    gap = lambda j: 6 * sum(s <= j for s in splits)  # a gap before each split column
    for j, c in enumerate(cols):
        svg.text(x0 + j * CELL + gap(j) + CELL / 2, y0 + 6, c[:2], "note", "middle")
    for i, (r, name_i) in enumerate(zip(cells, rows)):
        y = y0 + 14 + i * CELL
        svg.text(x0 - 6, y + CELL / 2, name_i, anchor="end")
        for j, v in enumerate(r):
            x, cls = x0 + j * CELL + gap(j) + 1, "seen" if v else "unseen"
            svg.rect(x, y + 1, CELL - 2, CELL - 2, cls, data_grid=name, data_row=i, data_col=j)
    return y0 + 14 + len(rows) * CELL


def conv_taps(reads, B: int, T: int) -> Svg:
    """A line of class tap from input box r up to output box i where row i reads row r (reads)."""
    title = f"The convolution's taps: T = {T}, B = {B}: no tap crosses a block"
    svg, S, w = Svg(title), len(reads), 44
    x_of = lambda r: 100 + r * w + 24 * (r // B)
    for label, y in (("output", 40), ("input", 150)):
        svg.text(10, y + 10, label)
        for r in range(S):
            svg.rect(x_of(r), y, w - 8, 20, "token", data_side=label, data_row=r)
            svg.text(x_of(r) + (w - 8) / 2, y + 10, f"b{r // B}s{r % B}", anchor="middle")
    for i in range(S):
        for r in range(S):
            if reads[i][r]:
                x1, x2 = x_of(r) + (w - 8) / 2, x_of(i) + (w - 8) / 2
                svg.line(x1, 150, x2, 60, "tap", data_out=i, data_in=r)
    for b in range(1, S // B):
        x = x_of(b * B) - 16
        svg.line(x, 30, x, 180, "sep")
    svg.text(10, 200, f"row i reads rows i - t (t < {T}), down to its block's slot 0", "note")
    return svg


def lattice(anchor, cands, unary, scores, walk, unary_path, title) -> Svg:
    """One block's selector lattice: slot j's candidates (cands, unary [L][K]), edges p -> c scored
    scores[j][p][c] (slot 1: from the anchor, p = 0); walk and unary_path [L]: each path's picks."""
    svg, L, K = Svg(title), len(cands), len(cands[0])
    col, rowh, bw = 250, 56, 120
    y_of = lambda k: 50 + k * rowh
    x_of = lambda j: 20 + j * col  # column 0: the anchor
    for j in range(L):
        for p in range(1 if j == 0 else K):  # slot 1's edges come from the anchor
            for c in range(K):
                on_walk = walk[j] == c and (j == 0 or walk[j - 1] == p)
                on_unary = unary_path[j] == c and (j == 0 or unary_path[j - 1] == p)
                cls = "walk" if on_walk else "unary" if on_unary else "edge"
                x1, y1 = x_of(j) + bw, y_of(p if j else (K - 1) / 2) + 14
                x2, y2 = x_of(j + 1), y_of(c) + 14
                svg.line(x1, y1, x2, y2, cls, data_slot=j + 1, data_from=p, data_to=c)
                if on_walk and on_unary:  # both paths take this edge: draw the unary one too
                    svg.line(x1, y1, x2, y2, "unary", data_slot=j + 1, data_from=p, data_to=c)
                t = 0.5 if j == 0 else 0.25  # where the labels of K x K edges stay apart
                x, y, score = x1 + t * (x2 - x1), y1 + t * (y2 - y1), f"{scores[j][p][c]:.2f}"
                svg.label(x, y, score, data_slot=j + 1, data_from=p, data_to=c)
    svg.rect(x_of(0), y_of((K - 1) / 2), bw, 28, "anchor")
    svg.text(x_of(0) + bw / 2, y_of((K - 1) / 2) + 14, f"{anchor} (anchor)", anchor="middle")
    for j in range(L):
        svg.text(x_of(j + 1) + bw / 2, 36, f"slot {j + 1}", "note", "middle")
        for k in range(K):
            kind = "node walk" if walk[j] == k else "node"
            label = f"{cands[j][k]}  u {unary[j][k]:.2f}"
            svg.box(x_of(j + 1), y_of(k), bw, 28, kind, label, data_slot=j + 1, data_k=k)
    y = y_of(K) + 10
    svg.line(20, y, 60, y, "walk")
    svg.text(70, y, "the walk: the best edge after the previous pick")
    svg.line(20, y + 20, 60, y + 20, "unary")
    svg.text(70, y + 20, "the unary path: each slot's best unary score alone")
    svg.text(
        20, y + 42, "a node: a candidate c and its unary score u[c]; an edge: s(p -> c)", "note"
    )
    return svg


def tree_nodes(svg, x0, y0, t, texts, path, bonus, labels=None, departs=()) -> float:
    """A tree t (texts [n]) left to right by depth, a box of its tree_kinds kind per node, the bonus
    after the accepted path; labels [n]: edge labels; departs: the nodes starred -> the y below."""
    n, colw, rowh, bw = len(t.tokens), 170, 26, 110
    parents, depth, children = t.parents, t.depths, t.children()
    row, taken, stack = {}, {}, [0]  # rows depth-first, best child first: siblings stay together
    while stack:
        i = stack.pop()
        row[i] = taken.get(depth[i], 0)
        taken[depth[i]] = row[i] + 1
        stack += children[i][::-1]
    kinds = tree_kinds(t, path)
    xy = lambda i: (x0 + depth[i] * colw, y0 + row[i] * rowh)
    last = path[-1] if path else 0
    below = [row[i] for i in range(n) if depth[i] == depth[last] + 1]  # the next depth's rows
    bonus_row = row[last] if row[last] not in below else len(below)
    bonus_xy = (x0 + (depth[last] + 1) * colw, y0 + bonus_row * rowh)
    for i in range(1, n):
        (px, py), (x, y) = xy(parents[i]), xy(i)
        cls = "accepted" if i in path else "edge"
        svg.line(px + bw, py + 11, x, y + 11, cls, data_from=parents[i], data_to=i)
        if labels:
            svg.label((px + bw + x) / 2, (py + y) / 2 + 11, labels[i])
    (px, py), (x, y) = xy(last), bonus_xy
    svg.line(px + bw, py + 11, x, y + 11, "bonus", data_from=last, data_to="bonus")
    for i, kind in enumerate(kinds):
        tip, star = f"node {i}: {kind}", i in departs
        svg.box(*xy(i), bw, 22, kind, texts[i][:14], star, tip, data_node=i, data_depth=depth[i])
    tip, deeper = "the target's bonus token", depth[last] + 1
    svg.box(*bonus_xy, bw, 22, "bonus", bonus[:14], tip=tip, data_node="bonus", data_depth=deeper)
    return y0 + max(max(taken.values()), bonus_row + 1) * rowh


def story_tree(t, texts, path, bonus, probs, title) -> Svg:
    """walkthrough.py's tree t after a target's walk, each edge labelled with its probability."""
    svg = Svg(title)
    labels = [""] + [f"{p:.3f}" for p in probs[1:]]
    y = tree_nodes(svg, 20, 40, t, texts, path, bonus, labels)
    legend(svg, 20, y + 16, tree=False, departs=False)
    return svg


# ----------------------------------------------------------------------------- a decoding
# The kinds of a cycle's drafts, as --show prints them (support/show.py) and a picture draws them:
# plain brackets, ANSI colour, meaning.
SHOW_KINDS = {
    "accepted": ("[", "]", "30;42", "accepted draft"),
    "rejected": ("{", "}", "97;41", "first rejected draft"),
    "unchecked": ("(", ")", "2", "later draft, never checked"),
    "bonus": ("<", ">", "30;46", "the target's bonus token"),
}
DEPARTS = (
    "*: the proposal is not the unary argmax there (the selector's path departs, or sampling did)"
)
BRANCHES = (
    "*: an accepted node that is not its parent's best child (a path would have stopped there)"
)


def path_slots(drafts, unary, accepted: int, bonus) -> list:
    """A path cycle's slots (token, kind, departs): `accepted` drafts accepted, one rejected, the
    rest unchecked, each departing where it is not its slot's unary argmax; then the bonus."""
    kinds = (["accepted"] * accepted + ["rejected"] + ["unchecked"] * len(drafts))[: len(drafts)]
    return [(d, k, d != u) for d, u, k in zip(drafts, unary, kinds)] + [(bonus, "bonus", False)]


def tree_kinds(t, path) -> list:
    """Each node's kind in a tree t whose accepted nodes are `path`: node 0 the anchor; accepted;
    rejected, a child of the anchor or of an accepted node (the walk read it, passed it by);
    unchecked, the rest, below a rejected node."""
    checked = {0, *path}  # the nodes whose row of logits the walk read
    return ["anchor"] + [
        "accepted" if i in path else "rejected" if t.parents[i] in checked else "unchecked"
        for i in range(1, len(t.tokens))
    ]


def branches(t, path) -> list:
    """The accepted nodes that are not their parent's best child: where a path would stop."""
    children = t.children()
    return [i for i in path if children[t.parents[i]][0] != i]


def legend(svg, x, y, tree: bool, departs=True) -> float:
    """A row of the four kinds of --show's blocks (SHOW_KINDS), then the `*` rule."""
    for kind, (*_, meaning) in SHOW_KINDS.items():
        svg.rect(x, y - 8, 14, 14, kind)
        svg.text(x + 20, y, meaning, "note")
        x += 20 + CHAR * len(meaning) + 16
    if departs:
        svg.text(10, y + 20, "*", "departs")
        svg.text(22, y + 20, (BRANCHES if tree else DEPARTS)[3:], "note")
    return y + 20 * departs


def decoding(cycles, text, title: str) -> Svg:
    """generate.py --show-svg: each cycle (show.Cycle) a group of class cycle (data-tau), its drafts
    marked as --show marks them; text(id) -> the token's text."""
    svg = Svg(title)
    is_tree = any(c.tree is not None for c in cycles)
    y = legend(svg, 10, 40, is_tree) + 30
    n = 0
    for c in cycles:
        if c.drafts is None:  # the prefill's token
            svg.text(10, y, f"prefill: the target's first token {text(c.new[0])!r}", "note")
            y += 26
            continue
        n += 1
        svg.group("cycle", data_cycle=n, data_tau=c.accepted + 1)
        svg.text(10, y + 6, f"{n:3d}  tau {c.accepted + 1}")
        if c.tree is None:
            y = path_row(svg, 120, y, c, text) + 10
        else:
            t, departs = c.tree, branches(c.tree, c.path)
            texts = [text(x) for x in t.tokens]
            y = tree_nodes(svg, 120, y - 5, t, texts, c.path, text(c.bonus), None, departs) + 14
        svg.end_group()
    return svg


def path_row(svg, x, y, c, text) -> float:
    """One path cycle's drafts and bonus as boxes on one row -> the y below it."""
    for j, (d, kind, departs) in enumerate(path_slots(c.drafts, c.unary, c.accepted, c.bonus)):
        label = text(d)
        w = max(28, CHAR * len(label) + 10)
        svg.box(x, y - 5, w, 22, kind, label, departs, f"slot {j + 1}: {kind}", data_slot=j + 1)
        x += w + 10
    return y + 22
