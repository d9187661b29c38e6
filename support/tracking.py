"""A training run's records: log.jsonl (RunLog) and, with --report-to, the same records sent to
wandb or TensorBoard; the final report (acceptance.json, the held-out summary, the served hint);
and read_log, which tools/ read a run's log.jsonl back with.
"""

import json
import os

import selector
from support.common import UsageError
from support.metrics import save_acceptance


class RunLog:
    """train.py's log.jsonl on rank 0 (on), each record also sent to track; --resume appends."""

    def __init__(self, args, on: bool, track=None):
        self.out_dir, self.on = args.out_dir, on
        os.makedirs(args.out_dir, exist_ok=True)  # the run's folder: ckpt.pt goes there too
        self.path = os.path.join(args.out_dir, "log.jsonl")
        if on and not args.resume and os.path.exists(self.path):
            os.remove(self.path)
        self.track = track

    def __call__(self, **record):
        if self.on:
            append_log(self.path, record)
        if self.track:
            self.track(record)

    def end(self, final: dict, cfg, step, elapsed_s):
        """A finished run on rank 0 (final: held-out metrics): acceptance.json, record, summary."""
        if not (self.on and final):
            return
        save_acceptance(self.out_dir, final, cfg, step)  # before the record: it pops what it keeps
        self(**{"kind": "final", "step": step, "elapsed_s": elapsed_s, **final})
        print_summary(final, cfg)
        print(f"\nserved tau (the real decoding loop): python -m tools.served {self.out_dir}")


def start_tracker(args):
    """--report-to's tracker, as nanoGPT's wandb_log: record -> its numbers sent as kind/key at its
    step (wandb: project dflash2; tensorboard: OUT_DIR/tb)."""
    name = args.report_to  # the package's name too
    try:  # here, not at the top: an optional package, imported only when asked for
        if name == "wandb":
            import wandb
        else:
            from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise UsageError(f"--report-to {name}: no {name} here (pip install {name})") from None
    if name == "wandb":
        run = wandb.init(project="dflash2", name=os.path.basename(args.out_dir), config=vars(args))
        return lambda r: run.log(numbers(r), step=r["step"])
    writer = SummaryWriter(os.path.join(args.out_dir, "tb"))

    def send(r):
        for key, value in numbers(r).items():
            writer.add_scalar(key, value, r["step"])
        writer.flush()  # a run that is killed keeps what it logged

    return send


def numbers(record: dict) -> dict:
    """A log.jsonl record's numbers, named kind/key (lists and texts left out)."""
    keep = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
    return {f"{record['kind']}/{k}": v for k, v in record.items() if k != "step" and keep(v)}


def append_log(path, record: dict):
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def print_summary(m, cfg):
    K = cfg.selector_top_k or selector.TOP_K
    rows = {
        "accept_unary": "accepted length, unary greedy path",
        "accept_selector": "accepted length, selector path",
        "accept_oracle": f"accepted length, oracle top-{K}",
        "topk_recall": f"top-{K} recall",
        "unary_acc": "unary accuracy",
        "sel_acc": "selector teacher-forced accuracy",
        "loss": "loss",
    }
    print("\nheld-out metrics")
    print("\n".join(f"  {name:40s} {m[k]:.4f}" for k, name in rows.items() if k in m))
    if "path_acc" in m:
        print(f"  {'selector path accuracy per position':40s} {m['path_acc']}")


def read_log(path: str) -> tuple:
    """A run folder or its log.jsonl -> (its folder, its records); a bad line names file, line."""
    file = os.path.join(path, "log.jsonl") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise UsageError(f"{path}: no log.jsonl there (a train.py --out-dir, or its log.jsonl)")
    records = []
    with open(file) as f:
        for n, line in enumerate(f, 1):
            try:
                r = json.loads(line)
            except json.JSONDecodeError as e:
                raise UsageError(f"{file} line {n}: not JSON ({e.msg})") from None
            if not (isinstance(r, dict) and isinstance(r.get("step"), int) and "kind" in r):
                raise UsageError(f"{file} line {n}: not a train.py record (kind, step, ...)")
            records.append(r)
    if not records:
        raise UsageError(f"{file}: no records yet (train.py writes one every --log-interval steps)")
    return os.path.dirname(os.path.abspath(file)), records
