"""Served acceptance: held-out prompts decoded greedily by the real loop (decoding.py), so that a
trained draft reports the tau a user will see beside the teacher-forced one (docs/acceptance.md).

    python -m tools.served OUT_DIR         # the draft as stored, the stock target, a path of B-1
    python -m tools.served OUT_DIR --fast  # speed/tune.py's precision, GEMMs and tree (run.sh's)

It reads OUT_DIR/ckpt.pt and adds its numbers to OUT_DIR/acceptance.json and log.jsonl ("served").
"""

import argparse
import copy
import os
import sys
import time

import torch
from tqdm import tqdm

import data
import loss
import train
from export import load_any
from speed import machine, tune
from support import distributed
from support.common import UsageError, count, dtype_name, positive, run
from support.compiling import anything_compiles
from support.loader import static_shapes
from support.metrics import add_into, record_served, reduce_metrics
from support.show import label, speculate
from support.target import check_draft_fits, load_target, stop_token_ids
from support.tracking import append_log, read_log


def prompt_length(loss_mask) -> int:
    """A held-out sequence's prompt: the tokens before its first supervised one. loss_mask [S]."""
    return int(loss_mask.nonzero()[0, 0])


@torch.no_grad()
def serve(
    target,
    draft,
    samples,
    shape,
    use_selector=True,
    stop_ids=(),
    max_new_tokens=None,
    until=None,
    head=None,
):
    """Each sample's prompt decoded greedily for its answer's length (at most max_new_tokens),
    verifying shape ("path", k) or ("tree", n) -> {"tau" over all cycles, "cycles", "tokens",
    "anchors" of each sample}. After time.time() `until` no prompt but the first is begun. head:
    what scores the draft's rows (--fast: speed/tune.decoding's; None: the target's head)."""
    device = next(target.parameters()).device
    taus, anchors, tokens, t0 = [], [], 0, time.time()
    bar = tqdm(samples, desc=f"served, {label(shape)}", unit="prompt", dynamic_ncols=True)
    for i, s in enumerate(bar):
        if i and until is not None and time.time() > until:
            break
        P = prompt_length(s["loss_mask"])
        prompt = s["input_ids"][None, :P].to(device)  # [1, P]
        n = min(len(s["input_ids"]) - P, max_new_tokens or len(s["input_ids"]))  # answer's length
        _, stats = speculate(
            target, draft, prompt, n, shape, use_selector=use_selector, stop_ids=stop_ids, head=head
        )
        taus += stats.taus
        tokens += stats.new_tokens
        # the anchors it visited, one a cycle: s_0 = P, s_{i+1} = s_i + tau_i
        anchors.append([P + sum(stats.taus[:i]) for i in range(len(stats.taus))])
        bar.set_postfix(tok_s=f"{tokens / (time.time() - t0):.1f}")
    tau = sum(taus) / len(taus) if taus else float("nan")
    return {"tau": tau, "cycles": len(taus), "tokens": tokens, "anchors": anchors}


def served_evaluation(
    args, draft, target, tokenizer, samples, fast, max_new_tokens=None, until=None
):
    """The prompts decoded on the path of B-1 drafts (fast: and the tree of tune.FAST_TREE nodes),
    the path's anchors scored teacher-forced (equal when the answers are the target's own greedy
    ones) -> acceptance.json's "served". args: the run's flags; draft: as stored, on the target's
    device; until: each shape gets an equal share of the time left."""
    device = next(target.parameters()).device
    # teacher-forced as train.py scores: its precision, and the target's embedding and head in the
    # dtype training loaded the target in (taken before --fast may pack the target's weights)
    weights = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    as_trained = machine.resolve_dtype(args.target_dtype, device, "data")
    embed_w, head_w = (w.detach().to(as_trained).to(device, torch.float32) for w in weights)
    bf16 = machine.resolve_dtype(args.dtype, device, "train") == torch.bfloat16
    autocast = lambda: torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16)
    use_selector = draft.candidate_selector is not None
    mode = "selector" if use_selector else "unary"
    path = ("path", draft.config.block_size - 1)
    shapes, served, head = {"path": path}, draft.eval(), None
    stored = f"draft {dtype_name(next(draft.parameters()).dtype)} as stored"
    if fast:  # the draft is changed in place (precision): a copy
        served, head, _, line = tune.decoding(target, copy.deepcopy(draft).eval(), "auto", "auto")
        print(f"--fast replaces the {stored} and the stock target GEMMs: {line}", file=sys.stderr)
        shapes["auto"] = ("tree", tune.FAST_TREE)  # the key's name: logs and acceptance.json's
        print(f"--fast adds the {label(shapes['auto'])} beside the {label(path)}", file=sys.stderr)
    else:
        dtype = dtype_name(next(target.parameters()).dtype)
        line = f"{stored}; target {dtype} (auto for decoding: speed/machine.py), stock GEMMs"
        print(f"served.py: {line}; the {label(path)} (--fast: speed/tune.py's)", file=sys.stderr)
    stop = stop_token_ids(target, tokenizer)
    out = {}
    kw = dict(use_selector=use_selector, stop_ids=stop, max_new_tokens=max_new_tokens, head=head)
    for i, (name, shape) in enumerate(shapes.items()):
        share = None if until is None else time.time() + (until - time.time()) / (len(shapes) - i)
        out[name] = serve(target, served, samples, shape, until=share, **kw)
    samples = samples[: len(out["path"]["anchors"])]  # the prompts that fitted
    anchors = [  # where the data has the block's first label: a training anchor position
        sorted(set(visited) & set(loss.anchor_positions(s["loss_mask"]).tolist()))
        for s, visited in zip(samples, out["path"]["anchors"])
    ]
    online = target if args.online else None
    tf = taught_at(draft, embed_w, head_w, samples, anchors, args, online, device, autocast)
    result = {
        "prompts": len(samples),
        "path_tau": round(out["path"]["tau"], 4),
        "path_cycles": out["path"]["cycles"],
        "path_tf_tau": round(tf[f"accept_{mode}"], 4),
        "path_tf_blocks": sum(map(len, anchors)),
    }
    if fast:
        auto = out["auto"]
        result.update(auto_shape=label(shapes["auto"]), auto_tau=round(auto["tau"], 4))
        result["auto_cycles"] = auto["cycles"]
    return result


@torch.no_grad()
def taught_at(draft, embed_w, head_w, samples, anchors, args, target, device, autocast) -> dict:
    """Teacher-forced metrics (train.py's objective, its flags) of sequence i at anchors[i], the
    anchors serving visited (data.collate with given anchors), one sequence a batch."""
    objective = train.DraftObjective(
        draft, embed_w, head_w, train.loss_config(args), args.attention
    ).eval()
    acc = {}
    for i, (sample, given) in enumerate(zip(samples, anchors)):
        batch = data.collate(
            [[sample]], [10_000_000 + i], args.num_anchors, args.seed, device, anchors=[given]
        )
        batch = static_shapes(batch, args.num_anchors) if anything_compiles(args) else batch
        if target is not None:
            data.add_target_features(batch, target, draft.config, args.loss == "kl", False)
        with autocast():
            add_into(acc, objective(batch, alpha_t=None)["metrics"])
    return reduce_metrics(acc)


def print_served(s, final, cfg):
    """The served numbers beside the teacher-forced tau at random anchors of the final record."""
    mode = "selector" if cfg.dflash2 else "unary"
    path = f"path of {cfg.block_size - 1} drafts"
    print(
        f"\nserved: {s['prompts']} held-out prompts decoded greedily by the real loop\n"
        f"  {'tau teacher-forced, random anchors':40s} {final[f'accept_{mode}']:.4f}\n"
        f"  {'tau teacher-forced, served anchors':40s} {s['path_tf_tau']:.4f}"
        f"  ({s['path_tf_blocks']} blocks)\n"
        f"  {'tau served, ' + path:40s} {s['path_tau']:.4f}  ({s['path_cycles']} cycles)"
    )
    if "auto_shape" in s:
        auto = f"tau served, --fast: {s['auto_shape']}"
        print(f"  {auto:40s} {s['auto_tau']:.4f}  ({s['auto_cycles']} cycles)")


# ----------------------------------------------------------------------------- the command line
def read_run(out_dir) -> tuple:
    """train.py's output directory -> (its flags, the draft as stored, its step, its final log
    record). A run that has not finished (no final record at the checkpoint's step: train.py writes
    acceptance.json just before it) is refused."""
    file = os.path.join(out_dir, "ckpt.pt")
    if not os.path.isdir(out_dir):
        raise UsageError(f"{out_dir}: no such directory (train.py's --out-dir)")
    if not os.path.isfile(file):
        raise UsageError(f"{file}: no training checkpoint (train.py writes it)")
    draft = load_any(file)  # refuses a checkpoint that is not one, in one line
    saved = torch.load(file, map_location="cpu", mmap=True, weights_only=True)
    if not isinstance(saved.get("args"), dict):
        raise UsageError(f"{file}: no training flags ('args'): not written by train.py")
    finals = [r for r in read_log(out_dir)[1] if r["kind"] == "final"]
    if not finals or finals[-1].get("step") != saved.get("step"):
        raise UsageError(
            f"{out_dir}/log.jsonl: no final record at {file}'s step {saved.get('step')}: the "
            "run has not finished (train.py --resume continues it)"
        )
    # a flag added after the run was written takes its default: what the run trained with
    defaults = vars(train.parse_args(["--data", saved["args"]["data"]]))
    flags = {**defaults, **saved["args"]}
    return argparse.Namespace(**flags), draft, saved.get("step"), finals[-1]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.formatter_class, a = argparse.RawDescriptionHelpFormatter, p.add_argument
    a("out_dir", metavar="OUT_DIR", help="train.py's --out-dir (ckpt.pt, log.jsonl)")
    a("--samples", type=count, default=16, help="held-out prompts")
    a("--max-new-tokens", type=count, default=None, help="default: the answer's")
    a("--fast", action="store_true", help="speed/tune.py's precision, GEMMs and tree")
    a("--max-seconds", type=positive, help="decode the prompts that fit this long, loading too")
    return p.parse_args(argv)


def main(argv=None):
    opts = parse_args(argv)
    t0 = time.time()
    args, draft, step, final = read_run(opts.out_dir)
    held = args.eval_data or args.data
    if not os.path.exists(held):
        raise UsageError(f"{held}: the held-out data of {opts.out_dir} is not there")
    device = distributed.rank_device()
    target, tokenizer = load_target(args.target, machine.resolve_dtype("auto", device, "decode"))
    target = target.to(device)
    check_draft_fits(draft.config, target)
    if args.eval_data:  # data.load_split's held-out sequences, without reading --data
        kw = args.chat_template_kwargs
        samples = data.load_samples(held, args.online, tokenizer, args.max_length, kw)
    else:
        samples = data.load_split(args, tokenizer)[1]
    chosen = [samples[i] for i in range(min(len(samples), opts.samples))]
    if not chosen:
        raise UsageError(f"{held}: no held-out sequences (train.py --eval-data, --eval-fraction)")
    draft = draft.to(device)
    until = opts.max_seconds and t0 + opts.max_seconds
    s = served_evaluation(
        args, draft, target, tokenizer, chosen, opts.fast, opts.max_new_tokens, until
    )
    s["seconds"] = round(time.time() - t0, 1)
    record_served(opts.out_dir, s)
    record = {"kind": "served", "step": step, **{f"served_{k}": v for k, v in s.items()}}
    append_log(os.path.join(opts.out_dir, "log.jsonl"), record)
    print_served(s, final, draft.config)


if __name__ == "__main__":
    run(main)
