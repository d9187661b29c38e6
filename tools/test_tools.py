"""The tests of tools/: machinery a learner can skip. Shared helpers come from test_all.py;
python -m pytest -q runs these with the rest (pyproject.toml's testpaths).

The map: each "# ====" banner and, indented under it, its "# ----" subsections (a test
holds it equal to the banners):
    tools/study.py                  seeds pooled per arm by hand
    tools/served.py: served acceptance
                                    teacher-forced at served anchors == the served cycle
    tools/gpu_check.py              --dry-run, prepare.py's shards, train.py's commands,
                                    rows written as they end, interrupted runs
    tools/llamacpp.py               the converter's keys; its refusals; parity's comparison
    tools/plot.py                   the charts draw the logged values; a bad run is one error
                                    line
    tools/mutants.py                the breaks load; a bad one is named, exit status 2
"""

import contextlib
import json
import os
import subprocess
import sys
import time
import types

import pytest
import torch
import torch.nn.functional as F

import decoding
import export
import loss as L
import model
import prepare
import train
from compat import config_json as config
from compat import serving
from model import capture_features
from speed import tune
from support import common, features, metrics, show
from support.common import UsageError
from test_all import (
    HERE,
    log_records,
    marks,
    prompt,
    run,
    svg_root,
    tiny_config,
    tiny_draft,
    tiny_target,
)
from tools import gpu_check, llamacpp, mutants, plot, served, study


# ============================================================================ tools/study.py
def test_study_pools_seeds_per_arm_by_hand(tmp_path):
    """A run's numbers (none before it served), an arm's mean +- sample sd over its seeds, each arm
    against the default beside twice the larger sd; unknown flags go to train.py."""

    def logged(name, final, served=None):
        (tmp_path / name).mkdir()
        records = [{"kind": "final", "step": 9, **final}]
        records += [{"kind": "served", "step": 9, **served}] if served else []
        (tmp_path / name / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        return study.numbers(str(tmp_path / name))

    assert study.numbers(str(tmp_path)) is None  # no log.jsonl
    assert logged("training", dict(accept_unary=1.0)) is None  # not served yet
    served = lambda path: dict(served_path_tau=path, served_auto_tau=2.2)  # --fast's tree too
    one = logged("a0", dict(accept_selector=2.0, accept_unary=1.6, topk_recall=0.5), served(1.8))
    two = logged("a1", dict(accept_selector=2.4, accept_unary=2.0, topk_recall=0.7), served(2.0))
    plain = logged("d0", dict(accept_unary=1.5, topk_recall=0.6), dict(served_path_tau=1.4))
    assert (one["lift"], plain["tau_selector"], plain["lift"]) == (1.25, None, None)
    rows = study.table({"a": [one, two], "dflash": [plain]}, ["a", "dflash"])
    # mean 2.2, sd sqrt(((2.0-2.2)^2 + (2.4-2.2)^2) / 1) = 0.283; lifts 1.25 and 1.2
    assert rows[2:] == [
        "| a | 2 | 2.200 +- 0.283 | 1.800 +- 0.283 | 1.225 +- 0.035 | 0.600 +- 0.141 "
        "| 1.900 +- 0.141 | 2.200 +- 0.000 |",
        "| dflash | 1 | - | 1.500 +- 0.000 | - | 0.600 +- 0.000 | 1.400 +- 0.000 | - |",
    ]
    runs = {  # held-out tau of the path each serves: the selector's, or the unary one
        "dflash2": [dict(tau_selector=2.0, tau_unary=1.9), dict(tau_selector=2.2, tau_unary=2.1)],
        "a": [dict(tau_selector=2.5, tau_unary=2.0), dict(tau_selector=2.7, tau_unary=2.0)],
        "b": [dict(tau_selector=2.1, tau_unary=2.0), dict(tau_selector=2.3, tau_unary=2.0)],
        "dflash": [dict(tau_selector=None, tau_unary=1.0), dict(tau_selector=None, tau_unary=1.2)],
        "one": [dict(tau_selector=9.0, tau_unary=9.0)],  # one seed: no spread, no verdict
    }
    # twice the larger sd: both 0.141 here
    assert study.verdicts(runs, ["dflash2", "a", "b", "dflash", "one"]) == [
        "- a: +0.500 against dflash2 (twice the spread: 0.283), above",
        "- b: +0.100 against dflash2 (twice the spread: 0.283), within noise",
        "- dflash: -1.000 against dflash2 (twice the spread: 0.283), below",
    ]
    args, train = study.PARSER.parse_known_args(["--toy", "--seeds", "2", "--lr", "1e-3"])
    assert (args.toy, args.seeds, train) == (True, 2, ["--lr", "1e-3"])


# =============================================================== tools/served.py: served acceptance
def fit(draft, target, sample, steps: int):
    """A few Adam steps of the objective at every anchor: a draft that accepts some drafts and
    misses others (a random one accepts almost nothing)."""
    embed_w, head_w = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    ids, mask = sample["input_ids"][None], sample["loss_mask"][None]
    anchors = L.anchor_positions(sample["loss_mask"])[None]
    opt = torch.optim.Adam(draft.parameters(), lr=3e-3)
    embed = lambda x: F.embedding(x, embed_w.detach())
    cfg = L.LossConfig(gamma=2.0)
    draft.train()
    for _ in range(steps):
        h = model.forward_training(draft, embed, ids, sample["features"][None], anchors)
        out = L.objective(
            draft, head_w.detach(), h, ids, mask, anchors, anchors >= 0, cfg, alpha_t=1.0
        )
        opt.zero_grad()
        out.numerator.backward()
        opt.step()
    return draft.eval()


@pytest.mark.parametrize("plain", [False, True])
def test_teacher_forced_at_served_anchors_equals_served_cycle_for_cycle(plain):
    """The answer being the target's own greedy one, the block teacher-forced at each anchor
    serving visited (s_0 = P, s_{i+1} = s_i + tau_i) accepts exactly what that cycle accepted.
    The sequence runs B tokens past what is served: every served block has all its labels."""
    torch.manual_seed(0)
    target, B, n = tiny_target("llama", initializer_range=0.3), 4, 40
    draft, p = tiny_draft(B, plain=plain), prompt()
    full, _ = decoding.target_generate(target, p, n + B)  # the answer: the target's greedy one
    P, mask = p.shape[1], torch.zeros_like(full[0])
    mask[P:] = 1
    feats = capture_features(target, draft.config.target_layer_ids, input_ids=full)[1][0]
    sample = {"input_ids": full[0], "loss_mask": mask, "features": feats}
    fit(draft, target, sample, steps=8)
    assert served.prompt_length(mask) == P
    shown = {k: v[: P + n] for k, v in sample.items()}  # served: the prompt and n answer tokens
    result = served.serve(target, draft, [shown], ("path", B - 1), use_selector=not plain)
    _, stats = show.speculate(target, draft, sample["input_ids"][None, :P], n, ("path", B - 1))
    anchors = result["anchors"][0]
    assert anchors == [P + sum(stats.taus[:i]) for i in range(len(stats.taus))]
    assert result["tau"] == pytest.approx(stats.mean_tau) and result["tokens"] == n
    # out of time (--max-seconds): the first prompt is decoded, no other is begun
    late = served.serve(target, draft, [shown] * 3, ("path", B - 1), until=time.time() - 1)
    assert late["anchors"] == [anchors] and late["tau"] == result["tau"]
    assert len(set(stats.taus)) >= 3  # accepted and rejected drafts alike: not a trivial case
    embed_w, head_w = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    mode = "accept_unary" if plain else "accept_selector"
    # the anchors through train.py's objective (data.collate with given anchors): one at a time,
    # each block accepts what its cycle did; all together, their mean
    args = train.parse_args(["--data", "d", "--gamma", "2", "--attention", "sdpa"])
    weights, cpu = (embed_w.detach(), head_w.detach()), torch.device("cpu")
    cpu_autocast = contextlib.nullcontext

    def taught(given):
        return served.taught_at(draft, *weights, [sample], given, args, None, cpu, cpu_autocast)[
            mode
        ]

    assert [taught([[a]]) for a in anchors] == [float(t) for t in stats.taus]
    assert taught([anchors]) == pytest.approx(stats.mean_tau, abs=1e-6)


def test_final_evaluation_reports_served_tau_beside_teacher_forced(setup, tmp_path, monkeypatch):
    """tools/served.py after train.py: served tau (the path; --fast adds its tree as "auto") beside
    teacher-forced tau at the served anchors, in the log and acceptance.json (export.py carries
    it); a user's mistake is one line."""
    monkeypatch.setenv("DFLASH2_CACHE", str(tmp_path / "cache"))
    run(setup, tmp_path / "run", "--max-steps", "2", "--eval-fraction", "0.3")
    served.main([str(tmp_path / "run"), "--samples", "2", "--fast"])
    records = log_records(tmp_path / "run" / "log.jsonl")
    record = [r for r in records if r["kind"] == "served"][-1]
    final = [r for r in records if r["kind"] == "final"][-1]
    s = json.loads((tmp_path / "run" / "acceptance.json").read_text())["served"]
    assert s == {k[len("served_") :]: v for k, v in record.items() if "served_" in k}
    assert not any("served_" in k for k in final) and record["step"] == final["step"] == 2
    assert s["prompts"] == 2 and 1 <= s["path_tau"] <= 4 and 1 <= s["auto_tau"] <= 4
    assert s["path_cycles"] >= 2 and 1 <= s["path_tf_tau"] <= 4
    assert s["path_tf_blocks"] <= s["path_cycles"]
    assert s["auto_shape"] == f"tree of {tune.FAST_TREE} nodes" and s["auto_cycles"] >= 1
    export.export(str(tmp_path / "run"), str(tmp_path / "out"))
    assert set(metrics.read_acceptance(str(tmp_path / "out"), 4)) == {"selector", "unary"}
    served.main([str(tmp_path / "run"), "--samples", "1", "--max-new-tokens", "3"])
    plain = json.loads((tmp_path / "run" / "acceptance.json").read_text())["served"]
    assert plain["prompts"] == 1 and "auto_shape" not in plain and 1 <= plain["path_tau"] <= 4
    assert plain["path_cycles"] <= 3  # each cycle commits a token at least
    served.main([str(tmp_path / "run"), "--samples", "2", "--fast", "--max-seconds", "1e-3"])
    late = json.loads((tmp_path / "run" / "acceptance.json").read_text())["served"]
    assert late["prompts"] == 1 and late["path_tf_blocks"] <= late["path_cycles"]
    # a run written before a flag existed reads it at its default, which the run trained with
    ckpt = torch.load(tmp_path / "run" / "ckpt.pt", weights_only=False)
    del ckpt["args"]["selector_weighting"]
    torch.save(ckpt, tmp_path / "run" / "ckpt.pt")
    assert served.read_run(str(tmp_path / "run"))[0].selector_weighting == "exp"
    with pytest.raises(UsageError, match="no such directory"):
        served.main([str(tmp_path / "none")])
    with pytest.raises(UsageError, match="no training checkpoint"):
        served.main([str(setup / "feats")])


# ============================================================================ tools/gpu_check.py
def test_gpu_check_dry_run_writes_results_and_summary(tmp_path):
    """tools/gpu_check.py --dry-run on the CPU at toy widths: train.py under torchrun gives a steady
    step time, decoding's path and tree equal plain decoding, item b says why it is skipped, and
    every CUDA test skips with needs_cuda's reason."""
    out = tmp_path / "gpu"
    cmd = [sys.executable, "-m", "tools.gpu_check", str(out), "--dry-run"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=HERE, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads((out / "results.json").read_text())
    assert list(results["items"]) == ["train", "compile", "decode", "tests"]
    t = results["items"]["train"]
    assert t["status"] == "measured" and t["steps_done"] == 6 and t["error_line"] is None, t
    assert t["steady_steps"] == 6 - gpu_check.WARM_STEPS and t["step_s"] > 0 and t["tokens_per_s"]
    assert "torch.distributed.run" in t["command"]
    assert results["items"]["compile"]["status"] == "skipped"
    d, B = results["items"]["decode"], results["items"]["decode"]["block_size"]
    assert d["status"] == "measured" and d["device"] == "cpu", d
    assert [(w["mode"], w["verify"], w["same"]) for w in d["ways"]] == [
        ("selector", f"path of {B - 1} drafts", d["prompts"]),
        ("selector", f"tree of {B - 1} nodes", d["prompts"]),
        ("plain stock", "", None),
    ]
    tests = results["items"]["tests"]
    assert tests["status"] == "measured" and tests["counts"].get("skipped", 0) >= 5, tests
    assert "failed" not in tests["counts"] and "passed" not in tests["counts"]
    skips = [s for s in (out / "tests.log").read_text().splitlines() if s.startswith("SKIPPED")]
    assert skips and all("needs a CUDA GPU" in line for line in skips), skips
    summary = (out / "summary.txt").read_text()
    assert tests["summary"] in summary and f"step_s {t['step_s']};" in summary
    assert "DRY RUN" in summary and "selector tree of" in summary


def test_gpu_check_gives_train_py_prepare_pys_shard_and_flags_it_takes(tmp_path, monkeypatch):
    """Items a and b run train.py with flags it takes (item b's only here: --dry-run skips it), on a
    random shard that is prepare.py --features' own: prepare.py's rerun with the same layers,
    length and shard size takes it as done; load_features reads its rows back."""
    args = gpu_check.parse_args([str(tmp_path), "--dry-run"])
    for item in ("train", "compile"):
        cmd = gpu_check.train_command(item, args, "C", "T", "F", "O")
        flags = train.parse_args(cmd[cmd.index("train.py") + 1 :])
        assert (flags.draft_config, flags.data, flags.out_dir) == ("C", "F", "O")
    draft = os.path.join(HERE, "configs", "qwen3-8b-dflash2.json")
    draft = gpu_check.toy_config(draft, str(tmp_path / "toy.json"))
    rows, (low, high) = 6, (40, 64)
    _, feat_dir = gpu_check.make_train_data(draft, str(tmp_path / "data"), (low, high), rows)
    layers = config.load_config(draft).target_layer_ids
    asked = []  # the settings prepare.py's rerun checks its shard against (it stops there)
    monkeypatch.setattr(prepare, "shard_done", lambda path, made, n: asked.append(made) or True)
    # N rows in one shard: prepare.py --max-length HIGH --shard-size N
    prepare.write_features(None, None, [[]] * rows, str(tmp_path), layers, high, shard_size=rows)
    assert features.shard_done(features.shard_path(feat_dir, 0), asked[0], rows)
    manifest = features.read_manifest(feat_dir)
    assert (manifest["target_layer_ids"], manifest["max_length"]) == (layers, high)
    assert manifest["num_samples"] == rows and manifest["chat_template_kwargs"] == {}
    samples = features.load_features(feat_dir)
    assert len(samples) == rows and "target_hidden" not in samples[0]
    for r in samples:
        n = len(r["input_ids"])
        assert low <= n <= high and r["features"].shape == (n, len(layers) * 64)
        assert r["loss_mask"].tolist() == [0] * (n // 10) + [1] * (n - n // 10)


def test_gpu_check_reads_the_steady_step_per_interval():
    """steady(): step 1's compile apart, the step time over the steps after the warm-up (never
    from the loop's start), per interval too; train.py's per-interval rates, their median."""
    compile_s, step_s, tokens = 60.0, 0.2, 3500
    records = [
        dict(kind="train", step=i, elapsed_s=round(compile_s + step_s * i, 1), mfu=0.3)
        | dict(target_tok_per_s=tokens / step_s if i > 1 else tokens / (compile_s + step_s))
        for i in range(1, 33)
    ]
    got = gpu_check.steady(records)
    assert got["step_s"] == pytest.approx(step_s, abs=0.005) and got["steady_steps"] == 30
    assert got["compile_s"] == pytest.approx(compile_s, abs=0.2)
    assert got["interval_step_s"] == pytest.approx([step_s] * 3, abs=0.011)
    assert got["tokens_per_s"] == tokens / step_s and got["mfu"] == 0.3
    for bad, says in (
        (records[::2], "one a step"),
        ([{"kind": "eval"}], "no train records"),
        ([r | {"elapsed_s": compile_s} for r in records], "below the log's resolution"),
    ):
        with pytest.raises(ValueError, match=says):
            gpu_check.steady(bad)


def test_gpu_check_writes_each_row_as_it_ends_and_its_summary_whatever_ends_it(
    tmp_path, monkeypatch
):
    """Each row is on disk before the next item starts; out of memory does not fail the check, a
    timeout does; a check stopped by Ctrl-C still writes what it did and what stopped it."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # --dry-run sets it: undone after the test
    seen = {}

    def item(name, args, *rest):
        done = os.path.join(args.out_dir, "results.json")
        seen[name] = list(json.load(open(done))["items"]) if os.path.exists(done) else []
        if ends[name] is None:
            raise KeyboardInterrupt
        return {"status": ends[name], "reason": None}

    monkeypatch.setattr(gpu_check, "run_item", item)
    for last, code in (("measured", 0), ("timed out", 1)):
        ends = {"train": "out of memory", "compile": "skipped", "decode": "measured", "tests": last}
        with pytest.raises(SystemExit) as stop:
            gpu_check.main([str(tmp_path / last), "--dry-run"])
        assert stop.value.code == code
    assert seen == {name: list(ends)[:i] for i, name in enumerate(ends)}  # those before it
    ends["decode"] = None
    with pytest.raises(KeyboardInterrupt):
        gpu_check.main([str(tmp_path / "cut"), "--dry-run"])
    results = json.loads((tmp_path / "cut" / "results.json").read_text())
    assert list(results["items"]) == ["train", "compile"]
    assert results["stopped"] == "KeyboardInterrupt: "  # and the summary says so
    summary = (tmp_path / "cut" / "summary.txt").read_text()
    assert "STOPPED: KeyboardInterrupt" in summary and "train: status out of memory" in summary


def test_gpu_check_bounds_a_run_and_says_how_it_ended(monkeypatch):
    """A run past its bound gets Ctrl-C first and INTERRUPT_S to print what it has, then is
    killed: timed out. One that ran out of memory says so (not a failure); one that failed gives
    its last line."""
    said = "import time\ntry:\n    time.sleep(30)\nexcept KeyboardInterrupt:\n    print('why')"
    # a bound of 4 s (its share, less INTERRUPT_S): the child is in its sleep by then
    cmd, share = [sys.executable, "-c", said], 4 + gpu_check.INTERRUPT_S
    status, seconds, out, peak = gpu_check.run_bounded(cmd, share)
    assert (status, out.strip(), peak) == (None, "why", None) and seconds < 14
    assert gpu_check.outcome(status, out, 60) == ("timed out", "its share of 60 s ran out")
    oom = "step 1\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 17.00 GiB\n  x"
    assert gpu_check.outcome(1, oom, 60) == ("out of memory", oom.splitlines()[1])
    assert gpu_check.outcome(1, "x\nerror: bad\n", 60) == ("failed", "exit status 1: error: bad")
    monkeypatch.setattr(gpu_check, "INTERRUPT_S", 2)  # one that ignores Ctrl-C is killed after it
    stubborn = "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\ntime.sleep(60)"
    status, seconds, out, _ = gpu_check.run_bounded([sys.executable, "-c", stubborn], 3)
    assert status is None and 3 <= seconds < 8


# ============================================================================ tools/llamacpp.py
def test_llamacpp_converter_reads_every_key_it_needs_from_an_export(tmp_path):
    """llama.cpp b11434's converter (conversion/qwen.py) falls back to a default where a key is
    missing, so every key must be in the export with this project's meaning: its reading, written
    out below (no build), equals the draft's."""
    layers = ["full_attention", "sliding_attention", "full_attention"]
    kw = dict(num_hidden_layers=3, layer_types=layers, sliding_window=6, is_causal=False)
    draft = tiny_draft(4, **kw)
    c, ck = draft.config, tmp_path / "ck.pt"
    torch.save({"model": draft.state_dict(), "config": config.config_to_dict(c)}, ck)
    export.export(str(ck), str(tmp_path / "out"), torch.float32)
    d = json.loads((tmp_path / "out" / "config.json").read_text())
    dc = d.get("dflash_config", {})
    assert d["architectures"] == ["DFlash2DraftModel"]  # qwen.py:721 maps it to DFlashModel
    # GGUF key -> value as the converter computes it from config.json (conversion/qwen.py lines)
    dflash2 = "conv_kernel_size" in dc  # :770, else plain DFlash
    sizes = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
    causal = d.get("is_causal", dc.get("causal"))  # :812-816; None: the key is not written
    swa = d.get("use_sliding_window") and (dc.get("swa_window_size") or d.get("sliding_window"))
    pattern = [t == "sliding_attention" for t in d.get("layer_types") or []]
    read = {
        "dflash.block_size": dc.get("block_size", d.get("block_size", 16)),  # :767
        "dflash.target_layers": [i + 1 for i in dc.get("target_layer_ids", [])],  # :798-801
        "tokenizer.ggml.mask_token_id": dc.get("mask_token_id"),  # :753-755
        **{f"dflash.{k}": dc.get(k) if dflash2 else None for k in sizes},  # :770-774
        # absent, the draft runs every layer non-causal (common/speculative.cpp:1013, :1122)
        "dflash.attention.causal": False if causal is None else bool(causal),
        "dflash.attention.sliding_window": swa or None,  # :803-810
        "dflash.attention.sliding_window_pattern": pattern if swa else None,
        # DSparkModel's reading (qwen.py:942-944); DFlashModel does not write the key, and the
        # loader assumes true where it is absent (src/models/dflash.cpp:317-318)
        "dflash.sample_from_anchor": d.get("sample_from_anchor", True),
        "dflash.block_count": d.get("num_hidden_layers"),  # conversion/base.py:1437
        "dflash.rope.freq_base": d.get("rope_parameters", {}).get("rope_theta"),  # base.py:1507
    }
    # The draft's meaning. llama.cpp extracts layer INPUTS: the input of layer i + 1 is the output
    # of layer i (HF hidden_states[i + 1]), the feature this project reads for target layer id i.
    meaning = {
        "dflash.block_size": c.block_size,
        "dflash.target_layers": [i + 1 for i in c.target_layer_ids],
        "tokenizer.ggml.mask_token_id": c.mask_token_id,
        **{f"dflash.{k}": getattr(c, k) for k in sizes},
        "dflash.attention.causal": c.causal_in_block(False),  # one flag for all layers there
        "dflash.attention.sliding_window": c.sliding_window,
        "dflash.attention.sliding_window_pattern": [t == "sliding_attention" for t in layers],
        "dflash.sample_from_anchor": False,  # slot 0 is the anchor, never a proposal
        "dflash.block_count": c.num_hidden_layers,
        "dflash.rope.freq_base": c.rope_theta,
    }
    assert read == meaning
    per_layer = {c.causal_in_block(t == "sliding_attention") for t in layers}
    assert per_layer == {meaning["dflash.attention.causal"]}
    assert c.target_layer_ids == [0, 2, 3] and read["dflash.target_layers"] == [1, 3, 4]
    # the selector codebooks are bare parameters; the converter appends ".weight" (qwen.py:915-919)
    names = set(export.load_tensors(str(tmp_path / "out")))
    assert {f"candidate_selector.{k}_codebook" for k in ("predecessor", "successor")} <= names


def test_llamacpp_refuses_at_conversion_what_its_dflash2_loader_refuses(tmp_path):
    """What llama.cpp's DFlash2 loader refuses (src/models/dflash.cpp: hidden_size %
    conv_group_size, hidden_size < K (K + 1)) is refused before anything is built; plain DFlash
    passes."""
    small, fits, cache = tmp_path / "small", tmp_path / "fits", tmp_path / "cache"
    export.save_draft(tiny_draft(4, selector_top_k=8), str(small))
    export.save_draft(tiny_draft(4), str(fits))
    with pytest.raises(UsageError, match=r"hidden_size 32 is below K \(K \+ 1\) = 72 for"):
        llamacpp.main(["convert", "--draft", str(small), "--cache", str(cache)])
    assert not cache.exists() and llamacpp.check_draft(str(fits)) is None
    # the group rule, which this project's own validation already enforces
    c = types.SimpleNamespace(dflash2=True, hidden_size=36, conv_group_size=8, selector_top_k=5)
    assert "hidden_size 36 is not divisible by conv_group_size 8" in serving.llamacpp_refusal(c)
    assert serving.llamacpp_refusal(model.plain_dflash(tiny_config(selector_top_k=8))) is None


def test_llamacpp_parity_reads_llamas_text_as_token_bytes_and_its_cycles_from_its_log(
    tmp_path, monkeypatch
):
    """Parity compares generate.py's tokens with llama.cpp's printed text as bytes (GPT-2's byte
    alphabet; a token outside it as its own text) and reads each cycle from its debug log."""
    vocab = ["Tom", "Ġhas", "Ċ", "✓"]
    tok = types.SimpleNamespace(convert_ids_to_tokens=lambda ids: [vocab[i] for i in ids])
    pieces = llamacpp.token_bytes(tok, [0, 1, 2, 3])
    assert pieces == [b"Tom", b" has", b"\n", "✓".encode()]
    assert llamacpp.tokens_matched("Tom has\n✓ more".encode(), pieces) == 4  # a prefix will do
    assert [llamacpp.tokens_matched(t, pieces) for t in (b"Tom had\n", b"Tom")] == [1, 1]
    # the two llama.cpp runs, through a stand-in that prints as llama.cpp does
    monkeypatch.setenv("LOG", "accepted 2/7 draft tokens, the last target token is: (198)\nx\n")
    fake = tmp_path / "fake"
    fake.write_text(
        "#!/bin/sh\nprintf 'Tom has [end of text]'\n"
        "echo 'prompt eval time =  3.0 ms /    12 tokens' >&2\necho \"$LOG\" >&2\n"
    )
    fake.chmod(0o755)
    bins = {"llama-completion": str(fake), "llama-speculative-simple": str(fake)}
    plain = llamacpp.run_plain(bins, "T.gguf", "p.txt", 96, 1)
    assert plain == {"text": b"Tom has", "ended": True, "prompt_tokens": 12}
    spec = llamacpp.run_spec(bins, "T.gguf", "D.gguf", "p.txt", 96, 1, 3)
    assert spec == {"stdout": b"Tom has [end of text]", "cycles": [(2, 7, 198)]}
    fake.write_text("#!/bin/sh\necho 'model not found' >&2\nexit 1\n")
    with pytest.raises(UsageError, match=r"^fake failed on T.gguf: model not found$"):
        llamacpp.run_plain(bins, "T.gguf", "p.txt", 96, 1)


# ============================================================================ tools/plot.py
def chart_points(path) -> dict:
    """A plot.py picture read back: {(chart title, run, series name): [(x, y)]}, each point mapped
    from its pixels to data through the chart's own first and last tick labels."""
    out = {}
    for chart in marks(svg_root(path), "g", "chart"):
        ticks = [e for e in marks(chart, "text", "tick")]
        maps = {}
        for axis in "xy":
            (v0, p0), *_, (v1, p1) = [
                (float(e.get("data-value")), float(e.get("data-px")))
                for e in ticks
                if e.get("data-axis") == axis
            ]
            maps[axis] = lambda px, v0=v0, p0=p0, v1=v1, p1=p1: (
                v0 + (px - p0) * (v1 - v0) / (p1 - p0)
            )
        lines, dots = {}, {}
        for e in marks(chart, "polyline", "series"):
            key = (chart.get("data-title"), e.get("data-run"), e.get("data-name"))
            lines[key] = [tuple(map(float, xy.split(","))) for xy in e.get("points").split()]
        for e in marks(chart, "circle", "point"):
            key = (chart.get("data-title"), e.get("data-run"), e.get("data-name"))
            dots.setdefault(key, []).append((float(e.get("cx")), float(e.get("cy"))))
        for key in lines.keys() | dots.keys():
            if key in lines and key in dots:  # a line with a dot at each point
                assert dots[key] == lines[key]
            out[key] = [(maps["x"](x), maps["y"](y)) for x, y in lines.get(key) or dots[key]]
    return out


def test_plot_draws_the_logged_values(setup, tmp_path):
    """tools/plot.py on a real train.py run (eval every 2 steps) and a hand-written one with served
    tau and acceptance.json: every point read back from the picture (through its axes' tick
    labels) is a log.jsonl value at its step, or acceptance.json's share at its block position."""
    flags = "--max-steps 4 --eval-interval 2 --eval-fraction 0.3 --log-interval 1"
    run(setup, tmp_path / "real", *flags.split())
    hand = tmp_path / "hand"
    hand.mkdir()
    records = [
        {"kind": "train", "step": 10, "loss": 4.0}, {"kind": "train", "step": 20, "loss": 3.0},
        {"kind": "train", "step": 25, "loss": 2.75, "base_loss": 2.25},  # the base term is drawn
        {"kind": "eval", "step": 20, "loss": 3.5, "accept_unary": 1.5, "accept_selector": 1.75},
        {"kind": "train", "step": 20, "loss": 2.5},  # a resumed run: the later record wins
        {"kind": "final", "step": 30, "loss": 2.0, "accept_unary": 2.0, "accept_selector": 2.5},
        {"kind": "served", "step": 30, "served_path_tau": 2.25},
    ]  # fmt: skip
    (hand / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    accepted = {
        "selector": {"accepted": [0.75, 0.5, 0.25]},
        "unary": {"accepted": [0.5, 0.25, 0.0]},
    }
    (hand / "acceptance.json").write_text(json.dumps({"block_size": 4, "step": 30, **accepted}))
    out = tmp_path / "runs.svg"
    plot.main([str(tmp_path / "real"), str(hand), "--labels", "real", "hand", "--out", str(out)])
    drawn = chart_points(out)
    # the hand-written run by hand: a step logged twice draws its later record; base_loss where
    # it is logged, else loss
    expect = {
        ("loss", "hand", "train loss"): [(10, 4.0), (20, 2.5), (25, 2.25)],
        ("loss", "hand", "held-out loss"): [(20, 3.5), (30, 2.0)],
        ("held-out tau", "hand", "selector path"): [(20, 1.75), (30, 2.5)],
        ("held-out tau", "hand", "unary path"): [(20, 1.5), (30, 2.0)],
        ("held-out tau", "hand", "served"): [(30, 2.25)],
        ("accepted up to block position", "hand", "selector"): [(1, 0.75), (2, 0.5), (3, 0.25)],
        ("accepted up to block position", "hand", "unary"): [(1, 0.5), (2, 0.25), (3, 0.0)],
    }
    # the real run: its training loss and held-out tau at every step it logged them
    real = log_records(tmp_path / "real" / "log.jsonl")
    losses = {r["step"]: r["base_loss"] for r in real if r["kind"] == "train"}
    taus = {r["step"]: r["accept_selector"] for r in real if r["kind"] in ("eval", "final")}
    expect[("loss", "real", "train loss")] = sorted(losses.items())
    expect[("held-out tau", "real", "selector path")] = sorted(taus.items())
    series = lambda run: {(title, name) for title, r, name in drawn if r == run}
    assert {(title, name) for title, r, name in expect if r == "hand"} == series("hand")
    assert series("real") == series("hand") - {("held-out tau", "served")}  # it never served
    for key, pts in expect.items():
        got = drawn[key]
        assert [x for x, _ in got] == pytest.approx([x for x, _ in pts], abs=0.02), key
        assert [y for _, y in got] == pytest.approx([y for _, y in pts], abs=0.01), key


def test_plot_refuses_a_bad_run_in_one_line(tmp_path, capsys):
    """A bad path or file ends in one line `error: ...` naming it, exit status 2; a flag mistake
    in argparse's usage and error."""
    bad, empty, acc = tmp_path / "bad", tmp_path / "empty", tmp_path / "acc"
    for d in (bad, empty, acc):
        d.mkdir()
    (bad / "log.jsonl").write_text('{"kind": "train", "step": 1, "loss": 2.0}\n{oops\n')
    (empty / "log.jsonl").write_text("")
    (acc / "log.jsonl").write_text('{"kind": "train", "step": 1, "loss": 2.0}\n')
    for argv, says, one_line in (
        ([str(tmp_path / "missing")], "no log.jsonl there", True),
        ([str(bad)], "log.jsonl line 2: not JSON", True),
        ([str(empty)], "log.jsonl: no records yet", True),
        ([str(acc)], "acceptance.json: not valid JSON", True),
        ([str(acc)], "acceptance.json: no block_size", True),
        ([str(acc), "--out", str(tmp_path / "no" / "p.svg")], "no folder", True),
        ([str(bad), str(bad)], "--out", False),
    ):
        if "acceptance.json" in says:
            (acc / "acceptance.json").write_text("{oops" if "JSON" in says else "[1]")
        else:
            (acc / "acceptance.json").unlink(missing_ok=True)
        with pytest.raises(SystemExit) as stop:
            common.run(lambda: plot.main(argv))
        err = capsys.readouterr().err.strip().splitlines()
        assert stop.value.code == 2 and "error: " in err[-1] and says in err[-1], err
        assert len(err) == 1 or not one_line, err


# ================================================================================= tools/mutants.py
def test_mutants_loads_its_breaks_and_names_a_bad_one(tmp_path, monkeypatch, capsys):
    """tools/mutants.toml loads clean; in a catalogue of five breaks the four bad ones are each
    named by number and field, and the run stops before any test with exit status 2."""
    rules, breaks, problems = mutants.load(mutants.DATA)
    assert problems == [] and breaks and {b.rule for b in breaks} <= set(rules)
    good = {k: getattr(breaks[0], k) for k in ("file", "old", "new", "rule", "tests", "why")}
    entries = [good, {**good, "od": "x"}, {k: v for k, v in good.items() if k != "why"}]
    entries += [{**good, "old": "no such snippet"}, {**good, "old": "\n"}]  # 0 times, many
    text = f'[rules]\n{json.dumps(good["rule"])} = {{ section = "1", phrase = "p" }}\n'
    for entry in entries:
        text += "[[break]]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in entry.items())
    (tmp_path / "m.toml").write_text(text)
    rules, breaks, problems = mutants.load(str(tmp_path / "m.toml"))
    assert [b.old for b in breaks] == [good["old"], "no such snippet", "\n"]
    assert len(problems) == 4  # breaks 2 to 5, each named by number and what is wrong
    for n, says in zip((2, 3, 4, 5), ("'od'", "'why'", "'no such snippet'", "'\\n'")):
        assert f": break {n} (" in problems[n - 2] and says in problems[n - 2], problems
    monkeypatch.setattr(mutants, "DATA", str(tmp_path / "m.toml"))
    assert mutants.main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.splitlines()) == len(problems)
