"""The tests of speed/: machinery a learner can skip. Shared helpers come from test_all.py;
python -m pytest -q runs these with the rest (pyproject.toml's testpaths).

The map: each "# ====" banner (a test holds it equal to the banners):
    speed/machine.py: the rule per CPU      other CPUs played by monkeypatch; the cache
    speed/gemm.py: packed weights           packed and MKL linears == nn.Linear, layouts switch
    speed/cost.py                           the GEMM layouts' tables
    speed/int8.py                           int8 weights by hand and within their rounding bound
    speed/tune.py                           the head's row counts, the verify shapes asked
"""

import json

import pytest
import torch

import generate
import prepare
import train
from speed import cost, int8, machine, tune
from speed.gemm import (
    LAYOUTS,
    MklLinear,
    PackedLinear,
    layout_of,
    pack_linears,
    set_layout,
    unpack_linears,
)
from support import target as frozen
from support.common import UsageError
from test_all import needs_int8, needs_mkl, tiny_draft, tiny_target

# =============================================================== speed/machine.py: the rule per CPU
BF16, FP32 = torch.bfloat16, torch.float32

# what torch reports on a few CPUs (arch, kernels, avx512_bf16, amx, oneDNN's cap) -> (data / train
# / draft dtype, why)
CPUS = {
    "avx512-bf16": (("x86_64", "AVX512", True, False, ""), BF16, "cpu AVX512 with avx512_bf16"),
    "amx": (("x86_64", "AVX512", True, True, ""), BF16, "cpu AVX512 with avx512_bf16 + amx"),
    "avx512-no-bf16": (("x86_64", "AVX512", False, False, ""), FP32, "cpu AVX512, no native bf16"),
    "avx2": (("x86_64", "AVX2", False, False, ""), FP32, "cpu AVX2, no native bf16"),
    "avx2-capped": (("x86_64", "AVX2", True, False, ""), FP32, "cpu AVX2 kernels (capped"),
    "onednn-capped": (("x86_64", "AVX512", True, False, "AVX2"), FP32, "AVX512 kernels (capped"),
    "graviton": (("aarch64", "SVE256", False, False, ""), FP32, "unknown to the rule"),
    "apple": (("arm64", "DEFAULT", False, False, ""), FP32, "unknown to the rule"),
}


def play_cpu(monkeypatch, cpu):
    """Make torch (and so machine.cpu_info) report CPUS[cpu]."""
    arch, capability, avx512_bf16, amx, onednn_isa = CPUS[cpu][0]
    monkeypatch.delenv("DFLASH2_CPU", raising=False)
    monkeypatch.setattr(machine.platform, "machine", lambda: arch)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", onednn_isa)


@pytest.mark.parametrize("cpu", CPUS)
def test_machine_rule_picks_each_phases_dtype_from_what_the_cpu_has(monkeypatch, cpu):
    """auto: bf16 where native (or on a GPU), else fp32; decoding's target fp32 everywhere
    (lossless); a named dtype is kept; --compile auto where the draft trains in bf16."""
    _, dtype, why = CPUS[cpu]
    play_cpu(monkeypatch, cpu)
    assert why in machine.native_bf16(machine.cpu_info())[1]
    for phase in ("data", "decode", "train", "draft"):
        cpu_want = FP32 if phase == "decode" else dtype
        assert machine.resolve_dtype("auto", "cpu", phase) == cpu_want, phase
        gpu_want = FP32 if phase == "decode" else BF16  # a device name needs no GPU
        assert machine.resolve_dtype("auto", torch.device("cuda:1"), phase) == gpu_want
        assert machine.resolve_dtype("fp16", "cpu", phase) == torch.float16
    assert bool(machine.slow_bf16_note(BF16, "cpu")) == (dtype == FP32)
    assert machine.slow_bf16_note(FP32, "cpu") == ""
    assert machine.compile_training("auto", "auto", "cpu") == (dtype == BF16)
    assert machine.compile_training("auto", "auto", torch.device("cuda:0"))
    assert not machine.compile_training("auto", "fp32", torch.device("cuda:0"))
    assert machine.compile_training("auto", "bf16", "cpu")  # a dtype named, not the CPU's
    assert not machine.compile_training(None, "auto", "cpu")
    assert machine.compile_training("on", "fp32", "cpu")
    line = machine.train_precision("auto", "auto", False, "cpu", compiled=True)[2][0]
    assert line.endswith(", compiled")
    monkeypatch.setenv("DFLASH2_CPU", "generic")  # any CPU looks unknown
    assert machine.resolve_dtype("auto", "cpu", "train") == FP32


def test_machine_rule_picks_the_drafts_precision(monkeypatch):
    """generate.py's draft: int8 weights on the x86 CPUs the rule knows, else bf16 where native,
    else fp32; int8 asked for where it cannot run is refused."""
    monkeypatch.setattr(machine.int8, "runs", lambda: True)
    for cpu, want in (("avx512-bf16", "int8"), ("avx2", "int8"), ("graviton", "fp32")):
        play_cpu(monkeypatch, cpu)
        assert machine.draft_precision("auto", "cpu") == want, cpu
        assert machine.draft_precision("fp32", "cpu") == "fp32"
        assert machine.draft_precision("int8", "cpu") == "int8"
    assert machine.draft_precision("auto", torch.device("cuda:0")) == "bf16"
    with pytest.raises(UsageError, match="--draft-dtype int8: .* CPU kernels"):
        machine.draft_precision("int8", torch.device("cuda:0"))
    monkeypatch.setattr(machine.int8, "runs", lambda: False)  # no quantized engine
    play_cpu(monkeypatch, "avx512-bf16")
    assert machine.draft_precision("auto", "cpu") == "bf16"
    play_cpu(monkeypatch, "avx2")
    assert machine.draft_precision("auto", "cpu") == "fp32"
    with pytest.raises(UsageError, match=r"--draft-dtype int8: .*\(AVX2; "):
        machine.draft_precision("int8", "cpu")


def test_machine_rule_picks_the_layout_and_refuses_what_cannot_run(monkeypatch):
    def never():
        raise AssertionError("measured where the rule can tell")

    choose = machine.choose_layout
    monkeypatch.setattr(machine, "mkl_packs_run", lambda: True)
    play_cpu(monkeypatch, "graviton")  # unknown: stock, nothing measured
    assert choose(FP32, "cpu", "auto", never) == ("stock", "stock GEMMs (unknown CPU)")
    play_cpu(monkeypatch, "avx2")
    assert machine.layouts_here(FP32, "cpu") == ["stock", "onednn", "mkl"]
    for ms, best in (
        ({"stock": 75.0, "onednn": 86.0, "mkl": 80.0}, "stock"),
        ({"stock": 40.0, "onednn": 32.0, "mkl": 35.0}, "onednn"),
        ({"stock": 95.0, "onednn": 120.0, "mkl": 61.0}, "mkl"),
    ):
        layout, why = choose(FP32, "cpu", "auto", lambda: ms)
        assert layout == best and f"stock {ms['stock']:.1f}, onednn" in why
    for dtype, device, wanted in ((torch.float16, "cpu", "auto"), (FP32, "cuda", "auto")):
        assert choose(dtype, device, wanted, never)[0] == "stock"
    assert choose(FP32, "cpu", None, never) == ("stock", "stock GEMMs")
    assert choose(FP32, "cpu", "stock", never) == ("stock", "stock GEMMs (asked)")
    assert choose(FP32, "cpu", "mkl", never) == ("mkl", "mkl GEMMs (asked)")
    # bf16: oneDNN where it runs and bf16 is native, never measured; MKL packs fp32 only
    monkeypatch.setattr(machine, "packed_bf16_runs", lambda: True)
    assert machine.layouts_here(BF16, "cpu") == ["stock", "onednn"]
    assert choose(BF16, "cpu", "auto", never)[0] == "stock"  # AVX2: no native bf16
    play_cpu(monkeypatch, "avx512-bf16")
    assert choose(BF16, "cpu", "auto", never)[0] == "onednn"
    # asked for what this machine cannot run: one line naming what is missing
    monkeypatch.setattr(machine, "packed_bf16_runs", lambda: False)
    for dtype, layout, missing in (
        (BF16, "onednn", "needs AVX-512"),
        (torch.float16, "onednn", "only for fp32 or bf16 targets on the CPU"),
        (BF16, "mkl", "only for fp32 targets on the CPU"),
    ):
        with pytest.raises(UsageError, match=f"--target-gemm {layout}.*{missing}"):
            choose(dtype, "cpu", layout, never)
    monkeypatch.setattr(machine, "mkl_packs_run", lambda: False)  # a torch without MKL (ARM)
    assert machine.layouts_here(FP32, "cpu") == ["stock", "onednn"]
    with pytest.raises(UsageError, match="--target-gemm mkl: this torch has no MKL"):
        choose(FP32, "cpu", "mkl", never)


def test_machine_cache_measures_once_per_machine_and_what(monkeypatch, tmp_path):
    path = tmp_path / "c" / "machine.json"
    monkeypatch.setattr(machine, "cache_path", lambda: str(path))
    calls, want = [], {"stock": {"1": 2.0}}
    measure = lambda: calls.append(1) or want
    key, other = machine.machine_key("decode", "t"), machine.machine_key("decode", "u")
    assert key != other and "threads" in key
    assert machine.cached(key, measure) == want and machine.cached(key, measure) == want
    assert len(calls) == 1  # the second read back
    machine.cached(other, measure)
    assert len(calls) == 2 and len(json.loads(path.read_text())) == 2
    path.write_text("{broken")  # measured again
    assert machine.cached(key, measure) == want and len(calls) == 3


def test_decoding_layouts_speculate_and_decode_plainly_each_in_their_faster_layout(monkeypatch):
    play_cpu(monkeypatch, "avx2")
    monkeypatch.setattr(machine, "mkl_packs_run", lambda: True)
    target, draft, sizes = tiny_target("llama"), tiny_draft(3), [1, 2, 3]
    ab = {"stock": (75.0, 5), "onednn": (86.0, 2), "mkl": (82.0, 4)}
    table = {k: {n: a + b * n for n in sizes} for k, (a, b) in ab.items()}
    measured = []
    monkeypatch.setattr(cost, "decode_table", lambda t, sizes: measured.append(sizes) or table)

    def chosen():  # -> (speculation's layout, plain decoding's, the target's now, why)
        layouts = cost.decoding_layouts(target, draft, "auto")
        return layouts["speculate"], layouts["plain"], layout_of(target), layouts["why"]

    # verifies of 2 and 3 tokens: 85 + 90 = 175 ms stock, 182 onednn, 184 mkl; a step 80 / 88 / 86
    *layouts, why = chosen()
    assert layouts == ["stock"] * 3
    assert why.endswith("; plain decoding stock (stock 80.0, onednn 88.0, mkl 86.0 ms)")
    table["stock"][3] = 100.0  # now 185 ms stock: onednn
    assert chosen()[:3] == ("onednn", "stock", "onednn")
    table["mkl"][3] = 80.0  # now 170 ms mkl
    assert chosen()[:3] == ("mkl", "stock", "mkl")
    assert measured == [[1, 2, 3]] * 3  # a plain step and every path's verify, 1..B tokens
    asked = cost.decoding_layouts(tiny_target("llama"), draft, "stock")  # nothing measured
    assert asked["table"] is None and asked["why"] == "stock GEMMs (asked)"


def test_every_script_asks_the_machine_rule_for_its_dtypes(monkeypatch, tmp_path):
    play_cpu(monkeypatch, "avx512-bf16")
    asked = []

    class Loaded(Exception):
        """Stops a script right after it asked load_target for a dtype."""

    def fake_load_target(name, dtype, layers=True):
        asked.append(dtype)
        raise Loaded

    # train.py loads its target through support.target.frozen_target
    for script in (prepare, generate, frozen):
        monkeypatch.setattr(script, "load_target", fake_load_target)
    monkeypatch.setattr(generate, "load_any", lambda path: None)
    for script, argv in (
        (prepare, ["--data", "d", "--out-dir", str(tmp_path), "--regenerate"]),
        (generate, ["--draft", "d", "--prompt", "hi"]),
        (train, ["--data", "d"]),
        (train, ["--data", "d", "--target-dtype", "fp16"]),
    ):
        with pytest.raises(Loaded):
            script.main(argv)
    # a CPU with native bf16: the target's data phase in bf16, decoding in fp32
    decode = BF16 if torch.cuda.is_available() else FP32
    assert asked == [BF16, decode, BF16, torch.float16]


# ==================================================================== speed/gemm.py: packed weights
KINDS = (torch.nn.Linear, *LAYOUTS.values())


def inputs() -> list:
    """1, 8, 2 x 3 and 65 rows (past MklLinear.MAX_ROWS: prefill), then 5 non-contiguous ones."""
    shapes = ((1, 1, 24), (1, 8, 24), (2, 3, 24), (1, MklLinear.MAX_ROWS + 1, 24))
    return [torch.randn(s) for s in shapes] + [torch.randn(24, 5).T]


@pytest.mark.parametrize(
    "kind,dtype",
    [
        (PackedLinear, FP32),
        (PackedLinear, BF16),
        pytest.param(MklLinear, FP32, marks=needs_mkl),
    ],
)
def test_packed_linears_equal_linear(kind, dtype):
    """Exact up to rounding in any summation order: |error| <= K eps (|x| |W|^T + |b|), K = 24."""
    torch.manual_seed(0)
    if dtype == BF16 and not machine.packed_bf16_runs():  # the probe agrees with oneDNN
        with pytest.raises(RuntimeError):
            kind(torch.nn.Linear(4, 3).bfloat16())(torch.randn(2, 4, dtype=BF16))
        return
    for bias in (False, True):
        lin = torch.nn.Linear(24, 40, bias=bias).to(dtype)
        packed = kind(lin)
        assert packed.weight is lin.weight  # the dense weight stays readable
        for x in inputs():
            x, b = x.to(dtype), lin.bias.double() if bias else 0
            want = x.double() @ lin.weight.double().T + b
            scale = x.double().abs() @ lin.weight.double().abs().T + abs(b)
            got = packed(x)
            assert got.dtype == dtype and got.shape == want.shape
            assert ((got.double() - want).abs() <= 24 * torch.finfo(dtype).eps * scale).all()


@needs_mkl
def test_mkl_linear_packs_once_per_row_count():
    """The weight packed for each row count the first time it comes, reused after; prefill's rows
    pack nothing."""
    mkl = MklLinear(torch.nn.Linear(24, 40))
    assert mkl.packs == {}
    for x in inputs():
        mkl(x)
    assert sorted(mkl.packs) == [1, 5, 6, 8]  # 1, 8, 2 x 3 and 5 rows; not 65
    pack = mkl.packs[6]
    mkl(torch.randn(6, 24))
    assert mkl.packs[6] is pack  # packed once


def test_set_layout_switches_layouts_with_the_same_logits_and_keeps_the_packs():
    """Coming back to a layout reuses its modules, MKL's packs included: bench.py switches layouts
    per prompt, and packing is not what it times."""
    target, ids = tiny_target("llama"), torch.randint(0, 64, (1, 5))
    weights, head = dict(target.state_dict()), target.get_output_embeddings().weight
    packed, seen = machine.layouts_here(FP32, "cpu")[1:], {}  # onednn, and mkl where it runs
    with torch.no_grad():
        want = target(input_ids=ids).logits
        for layout in packed + ["stock"] + packed:
            set_layout(target, layout)
            linears = [m for m in target.modules() if isinstance(m, KINDS)]
            kind = LAYOUTS.get(layout, torch.nn.Linear)
            assert [type(m) for m in linears] == [kind] * (4 * 7 + 1)
            assert target.get_output_embeddings().weight is head  # the draft reads it
            back, known = layout in seen, seen.setdefault(layout, linears)
            assert linears == known and layout_of(target) == layout
            # MKL's packs for 5 rows: made by the first visit's forward, kept for the next
            assert all(list(m.packs) == [5] * back for m in linears if kind is MklLinear)
            assert torch.allclose(target(input_ids=ids).logits, want, atol=1e-5)
        unpack_linears(target)  # the dense weights back in nn.Linear: the same logits, exactly
        assert torch.equal(target(input_ids=ids).logits, want)
    assert {type(m) for m in target.modules() if isinstance(m, KINDS)} == {torch.nn.Linear}
    assert all(torch.equal(target.state_dict()[k], v) for k, v in weights.items())
    with pytest.raises(UsageError, match="--target-gemm onednn: only for fp32 or bf16 targets"):
        pack_linears(tiny_target("llama").half())


# ============================================================================ speed/cost.py
def test_cost_tables_measure_every_layout_and_leave_the_target_stock(monkeypatch, tmp_path):
    monkeypatch.setattr(machine, "cache_path", lambda: str(tmp_path / "machine.json"))
    monkeypatch.setattr(machine, "mkl_packs_run", lambda: True)
    target, seen, extra = tiny_target("llama"), [], {"stock": 0.0, "onednn": 5.0, "mkl": 2.0}

    def target_ms(t, context, n, repeats, rows=1):
        seen.append((layout_of(t), n, rows))
        return 10.0 + n + extra[layout_of(t)]

    monkeypatch.setattr(cost, "target_ms", target_ms)
    table = cost.decode_table(target, (1, 8))
    assert table == {k: {1: 11.0 + v, 8: 18.0 + v} for k, v in extra.items()}
    assert seen == [(layout, n, 1) for layout in extra for n in (1, 8)]
    assert cost.decode_table(target, (1, 8)) == table and len(seen) == 6  # cached
    assert cost.data_costs(target) == {k: 10.0 + 1 + 10.0 + 256 + 2 * v for k, v in extra.items()}
    # the packed copies freed
    assert layout_of(target) == "stock" and "kept_layouts" not in target.__dict__


# ============================================================================ speed/int8.py
def test_int8_weights_hand_worked():
    """One scale per output row, s_o = max |w_o| / 127, q = round(w / s_o)."""
    q, s = int8.quantize_weight(torch.tensor([[0.5, -1.27, 0.0], [2.54, 1.0, -0.02]]))
    assert torch.allclose(s, torch.tensor([0.01, 0.02]))
    assert q.dtype == torch.int8 and q.tolist() == [[50, -127, 0], [127, 50, -1]]


@needs_int8
def test_int8_linear_stays_within_its_rounding_bound():
    """|x w - x^ w^| <= (s_o / 2) sum_i |x_i| + (a / 2) sum_i |w^_oi|: each weight is off by at most
    half its row's step s_o, each input by at most half the call's step a = (max(x, 0) - min(x, 0))
    / 127 (7-bit inputs)."""
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(40, 64, generator=g), torch.randn(2, 3, 64, generator=g) * 3
    y = int8.Int8Linear(w)(x)
    q, s = int8.quantize_weight(w)
    flat = x.reshape(-1, 64)
    a = (x.clamp_min(0).max() - x.clamp_max(0).min()) / 127  # one step per call, over all of x
    # [6, 40]
    bound = s / 2 * flat.abs().sum(1, keepdim=True) + a / 2 * (q.float() * s[:, None]).abs().sum(1)
    err = (y.reshape(-1, 40) - flat @ w.T).abs()
    assert y.shape == (2, 3, 40) and y.dtype == FP32
    assert (err <= bound * 1.001 + 1e-5).all() and err.max() > 1e-4  # within, and really int8


@needs_int8
def test_int8_draft_keeps_fc_in_fp32_and_its_head_in_int8():
    target, draft = tiny_target("qwen3"), tiny_draft(4)
    ref = draft.state_dict()
    head = int8.quantize(draft, target.get_output_embeddings().weight)
    kinds = (torch.nn.Linear, int8.Int8Linear)
    linears = {n: type(m) for n, m in draft.named_modules() if isinstance(m, kinds)}
    assert linears.pop("fc") is torch.nn.Linear and set(linears.values()) == {int8.Int8Linear}
    assert torch.equal(draft.fc.weight, ref["fc.weight"]) and isinstance(head, int8.Int8Linear)
    # every layer's projections, the convolutions' kernel projections and the selector's P are int8
    names = {n.rsplit(".", 1)[-1] for n in linears}
    projections = "q k v o gate up down kernel hidden".split()
    assert {f"{p}_proj" if len(p) < 5 else f"{p}_projection" for p in projections} <= names


# ============================================================================ speed/tune.py
def test_head_rows_takes_the_fastest_row_count_that_covers_the_slots():
    """Slots 1..L need r >= L + 1 rows: the fastest such r (ties: fewer rows); the full block may be
    the cheapest of all, as bf16 on an AMX Xeon."""
    assert cost.fastest_rows({2: 3.0, 3: 2.5, 4: 9.0, 5: 8.0}, 5) == {1: 3, 2: 3, 3: 5, 4: 5}
    assert cost.fastest_rows({2: 100.0, 3: 95.0, 4: 94.0, 5: 13.0}, 5) == {1: 5, 2: 5, 3: 5, 4: 5}
    assert cost.fastest_rows({2: 1.0, 3: 1.0, 4: 1.0, 5: 1.0}, 5) == {1: 2, 2: 3, 3: 4, 4: 5}


def test_verify_shapes_are_the_shapes_asked_and_a_path_fits_the_block():
    """--verify-tokens k: a path of k drafts, k at most B-1 (the drafts a cycle proposes), more
    refused; --tree-budget n: a tree of n nodes. Paths first, each in the order given."""
    parse = lambda *flags: generate.parse_args(["--draft", "d", *flags])
    args = parse("--tree-budget", "8", "--verify-tokens", "2", "7", "--bench", "gsm8k")
    assert tune.choose(args, 8)[2] == [("path", 2), ("path", 7), ("tree", 8)]
    with pytest.raises(UsageError, match=r"--verify-tokens: at most 2, .*\(block size 3\)"):
        tune.choose(args, 3)
    with pytest.raises(UsageError, match="at most 7"):  # B drafts: one more than a cycle proposes
        tune.choose(parse("--verify-tokens", "8"), 8)
    # the default: the path of B-1; --fast's: a tree of FAST_TREE nodes
    assert tune.choose(parse(), 8)[2] == [("path", 7)]
    assert tune.choose(parse("--fast"), 8)[2] == [("tree", tune.FAST_TREE)]
    with pytest.raises(SystemExit):  # auto is no value any more
        parse("--tree-budget", "auto")
