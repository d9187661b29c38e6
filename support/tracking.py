"""A training run's records: log.jsonl (RunLog), the final report (acceptance.json, the held-out
summary, the served hint), and experiment tracking: `train.py --report-to {none,wandb,tensorboard}`
sends each record train.py writes to log.jsonl to wandb or TensorBoard too, under the same names.

    {"kind": "train", "step": 40, "loss": 2.1, "path_acc": [0.9, 0.7], "auto_shape": "path"}
      -> at step 40: train/loss 2.1, train/path_acc/0 0.9, train/path_acc/1 0.7 (scalars),
         train/auto_shape "path" (text); a None (no value yet, e.g. grad_norm) is left out

The package is imported only when asked for, and one that is missing ends the run in one line
saying what to install; neither is in requirements.txt. wandb takes its project, entity and mode
from its own variables (WANDB_PROJECT, WANDB_MODE=offline...); TensorBoard's events go to
OUT/tensorboard (`tensorboard --logdir OUT/tensorboard`). log.jsonl stays the record of the run.
"""

import importlib
import json
import os

import selector
from support.common import UsageError
from support.metrics import save_acceptance

REPORT_TO = ("none", "wandb", "tensorboard")
PACKAGES = {"wandb": ("wandb", "wandb"), "tensorboard": ("torch.utils.tensorboard", "tensorboard")}


def flatten(record: dict):
    """A log.jsonl record -> (step, {name: number}, {name: text}); name = kind/key, a list's
    items kind/key/i."""
    prefix, numbers, texts = record["kind"], {}, {}
    for key, value in record.items():
        if key in ("kind", "step") or value is None:
            continue
        items = enumerate(value) if isinstance(value, list) else [(None, value)]
        for i, v in items:
            name = f"{prefix}/{key}" if i is None else f"{prefix}/{key}/{i}"
            if isinstance(v, (bool, int, float)):
                numbers[name] = float(v)
            elif v is not None:
                texts[name] = v if isinstance(v, str) else json.dumps(v)
    return record["step"], numbers, texts


def need(report_to: str):
    """The module --report-to needs, imported now; missing: UsageError saying what to install."""
    module, package = PACKAGES[report_to]
    try:
        return importlib.import_module(module)
    except ImportError:
        raise UsageError(
            f"--report-to {report_to} needs the {package} package: pip install {package}"
        ) from None


class Tracker:
    """log(record) for every log.jsonl record, close() at the end; --report-to none does
    nothing. config: the run's flags, stored with the run."""

    def __init__(self, report_to: str, out_dir: str, config: dict):
        self.report_to, self.run, self.writer = report_to, None, None
        if report_to == "wandb":
            self.run = need("wandb").init(dir=out_dir, config=config)
        elif report_to == "tensorboard":
            writer = need("tensorboard").SummaryWriter(os.path.join(out_dir, "tensorboard"))
            writer.add_text("config", json.dumps(config, indent=1, default=str))
            self.writer = writer

    def log(self, record: dict):
        step, numbers, texts = flatten(record)
        if self.run is not None:
            self.run.log({**numbers, **texts}, step=step)
        if self.writer is not None:
            for name, v in numbers.items():
                self.writer.add_scalar(name, v, step)
            for name, v in texts.items():
                self.writer.add_text(name, v, step)
            self.writer.flush()

    def close(self):
        if self.run is not None:
            self.run.finish()
        if self.writer is not None:
            self.writer.close()


# ---------------------------------------------------------------------------- log.jsonl and the end
class RunLog:
    """train.py's log.jsonl, on rank 0 (on): run_log(kind=..., step=..., ...) appends a record and
    sends it to --report-to's tracker; a fresh run starts a fresh log, --resume appends to it;
    end() writes a finished run's final report. On the other ranks nothing."""

    def __init__(self, args, on: bool):
        self.out_dir, self.on = args.out_dir, on
        os.makedirs(args.out_dir, exist_ok=True)  # the run's folder: ckpt.pt goes there too
        self.path = os.path.join(args.out_dir, "log.jsonl")
        self.tracker = Tracker(args.report_to if on else "none", args.out_dir, vars(args))
        if on and not args.resume and os.path.exists(self.path):
            os.remove(self.path)

    def __call__(self, **record):
        if self.on:
            append_log(self.path, record, self.tracker)

    def end(self, final: dict, cfg, step, elapsed_s):
        """final: the held-out metrics of a finished run ({}: none)."""
        if self.on and final:
            final_report(self.out_dir, self.path, final, cfg, step, elapsed_s, self.tracker)
        self.tracker.close()


def append_log(path, record: dict, tracker=None):
    """One log.jsonl record; --report-to sends it to the tracker too."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
    if tracker is not None:
        tracker.log(record)


def final_report(out_dir, log_path, final: dict, cfg, step, elapsed_s, tracker):
    """The end of a finished run, on rank 0: acceptance.json, the "final" record, the held-out
    summary and how to measure served tau."""
    save_acceptance(out_dir, final, cfg, step)  # before the record: it pops what it keeps
    append_log(log_path, {"kind": "final", "step": step, "elapsed_s": elapsed_s, **final}, tracker)
    print_summary(final, cfg)
    print(f"\nserved tau (the real decoding loop): python -m tools.served {out_dir}")


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
    """A run (its folder, or its log.jsonl) -> (its folder, its records). A line that is not a JSON
    object with a kind and a step is the user's to fix: UsageError naming the file and line."""
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
