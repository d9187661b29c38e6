"""The tests of speed/: machinery a learner can skip. Shared helpers come from test_all.py;
python -m pytest -q runs these with the rest (pyproject.toml's testpaths).

The map: each "# ====" banner and, indented under it, its "# ----" subsections (a test
holds it equal to the banners):
    speed/machine.py: the rule per CPU
                                    other CPUs played by monkeypatch: dtypes, layouts, refusals,
                                    the per-machine cache
    speed/gemm.py: packed weights   packed and MKL linears == nn.Linear, layouts switch
    speed/cost.py                   the GEMM layouts' tables
    speed/int8.py                   int8 weights by hand and within their rounding bound
    speed/tune.py                   the head's row counts, the verify shapes asked
"""

import json

import pytest
import torch

import generate
import prepare
import train
from speed import cost, int8, machine, tune
from speed.gemm import (
    MklLinear,
    PackedLinear,
    layout_of,
    pack_linears,
    packable,
    set_layout,
    unpack_linears,
)
from support import target as frozen
from support.common import UsageError
from test_all import needs_int8, needs_mkl, tiny_draft, tiny_target


# =============================================================== speed/machine.py: the rule per CPU
class Loaded(Exception):
    """Stops a script right after it asked load_target for a dtype."""


# what torch reports on a few CPUs -> (data / train / draft dtype, why, packed bf16 allowed by the
# rule)
CPUS = {
    "avx512-bf16": (
        ("x86_64", "AVX512", True, False, ""),
        torch.bfloat16,
        "cpu AVX512 with avx512_bf16",
    ),
    "sapphire-rapids": (
        ("x86_64", "AVX512", True, True, ""),
        torch.bfloat16,
        "cpu AVX512 with avx512_bf16 + amx",
    ),
    "avx512-no-bf16": (
        ("x86_64", "AVX512", False, False, ""),
        torch.float32,
        "cpu AVX512, no native bf16",
    ),
    "avx2": (("x86_64", "AVX2", False, False, ""), torch.float32, "cpu AVX2, no native bf16"),
    "avx2-capped": (("x86_64", "AVX2", True, False, ""), torch.float32, "cpu AVX2 kernels (capped"),
    "onednn-capped": (
        ("x86_64", "AVX512", True, False, "AVX2"),
        torch.float32,
        "cpu AVX512 kernels (capped",
    ),
    "graviton": (("aarch64", "SVE256", False, False, ""), torch.float32, "unknown to the rule"),
    "apple": (("arm64", "DEFAULT", False, False, ""), torch.float32, "unknown to the rule"),
}


def play_cpu(monkeypatch, arch, capability, avx512_bf16, amx, onednn_isa):
    """Make torch (and so machine.cpu_info) report another CPU."""
    monkeypatch.delenv("DFLASH2_CPU", raising=False)
    monkeypatch.setattr(machine.platform, "machine", lambda: arch)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", onednn_isa)


@pytest.mark.parametrize("cpu", CPUS)
def test_machine_rule_picks_each_phases_dtype_from_what_the_cpu_has(monkeypatch, cpu):
    reported, dtype, why = CPUS[cpu]
    play_cpu(monkeypatch, *reported)
    assert why in machine.native_bf16(machine.cpu_info())[1]
    for phase in ("data", "train", "draft"):
        assert machine.resolve_dtype("auto", "cpu", phase) == dtype, phase
    # lossless decoding, every CPU
    assert machine.resolve_dtype("auto", "cpu", "decode") == torch.float32
    # a device name needs no GPU; decoding's target stays fp32 there too (lossless)
    for phase in ("data", "decode", "train", "draft"):
        gpu = torch.float32 if phase == "decode" else torch.bfloat16
        assert machine.resolve_dtype("auto", torch.device("cuda:1"), phase) == gpu
        # an explicit name is kept
        assert machine.resolve_dtype("fp16", "cpu", phase) == torch.float16
    note = machine.slow_bf16_note(torch.bfloat16, "cpu")
    assert (
        bool(note) == (dtype == torch.float32)
        and machine.slow_bf16_note(torch.float32, "cpu") == ""
    )
    # the generic override: any CPU looks unknown
    monkeypatch.setenv("DFLASH2_CPU", "generic")
    assert machine.resolve_dtype("auto", "cpu", "train") == torch.float32


@pytest.mark.parametrize("cpu", CPUS)
def test_compile_auto_compiles_where_the_draft_trains_in_bf16(monkeypatch, cpu):
    """train.py --compile auto: compiled where the draft trains in bf16 (native bf16 on the CPU, or
    a GPU), eager in fp32 on a CPU; no flag is off and --compile is on, on every CPU."""
    reported, dtype, _ = CPUS[cpu]
    play_cpu(monkeypatch, *reported)
    assert machine.compile_training("auto", "auto", "cpu") == (dtype == torch.bfloat16)
    assert machine.compile_training("auto", "auto", torch.device("cuda:0"))
    assert machine.compile_training("auto", "fp32", torch.device("cuda:0")) is False
    assert machine.compile_training("auto", "bf16", "cpu")  # a dtype named, not the CPU's
    assert machine.compile_training(None, "auto", "cpu") is False
    assert machine.compile_training("on", "fp32", "cpu") is True
    line = machine.train_precision("auto", "auto", False, "cpu", compiled=True)[2][0]
    assert line.endswith(", compiled")


def test_machine_rule_picks_the_drafts_precision(monkeypatch):
    """generate.py's draft: int8 weights on the x86 CPUs the rule knows, else bf16 where native,
    else fp32."""
    monkeypatch.setattr(machine.int8, "runs", lambda: True)
    for cpu, want in (
        ("avx512-bf16", "int8"),
        ("avx2", "int8"),
        ("avx2-capped", "int8"),
        ("graviton", "fp32"),
    ):
        play_cpu(monkeypatch, *CPUS[cpu][0])
        assert machine.draft_precision("auto", "cpu") == want, cpu
        assert (
            machine.draft_precision("fp32", "cpu") == "fp32"
            and machine.draft_precision("int8", "cpu") == "int8"
        )
    assert machine.draft_precision("auto", torch.device("cuda:0")) == "bf16"
    with pytest.raises(UsageError, match="--draft-dtype int8: the int8 kernels are CPU kernels"):
        machine.draft_precision("int8", torch.device("cuda:0"))
    # no quantized engine: bf16 where native
    monkeypatch.setattr(machine.int8, "runs", lambda: False)
    play_cpu(monkeypatch, *CPUS["avx512-bf16"][0])
    assert machine.draft_precision("auto", "cpu") == "bf16"
    # else fp32; asked for, refused
    play_cpu(monkeypatch, *CPUS["avx2"][0])
    assert machine.draft_precision("auto", "cpu") == "fp32"
    with pytest.raises(
        UsageError,
        match=r"quantized kernels do not run on this CPU \(AVX2; fbgemm needs x86 with AVX2\)",
    ):
        machine.draft_precision("int8", "cpu")


def test_machine_rule_picks_the_layout_and_refuses_what_cannot_run(monkeypatch):
    def never():
        raise AssertionError("measured where the rule can tell")

    monkeypatch.setattr(machine, "mkl_packs_run", lambda: True)
    # unknown: stock, nothing measured
    play_cpu(monkeypatch, *CPUS["graviton"][0])
    assert machine.choose_layout(torch.float32, "cpu", "auto", never) == (
        "stock",
        "stock GEMMs (unknown CPU)",
    )
    play_cpu(monkeypatch, *CPUS["avx2"][0])
    assert machine.layouts_here(torch.float32, "cpu") == ["stock", "onednn", "mkl"]
    for ms, best in (
        ({"stock": 75.0, "onednn": 86.0, "mkl": 80.0}, "stock"),
        ({"stock": 40.0, "onednn": 32.0, "mkl": 35.0}, "onednn"),
        ({"stock": 95.0, "onednn": 120.0, "mkl": 61.0}, "mkl"),
    ):
        assert machine.choose_layout(torch.float32, "cpu", "auto", lambda: ms) == (
            best,
            f"{best} GEMMs (measured stock {ms['stock']:.1f}, onednn {ms['onednn']:.1f}, "
            f"mkl {ms['mkl']:.1f} ms)",
        )
    assert machine.choose_layout(torch.float16, "cpu", "auto", never) == ("stock", "stock GEMMs")
    assert machine.choose_layout(torch.float32, "cuda", "auto", never) == ("stock", "stock GEMMs")
    assert machine.choose_layout(torch.float32, "cpu", "stock", never) == (
        "stock",
        "stock GEMMs (asked)",
    )
    assert machine.choose_layout(torch.float32, "cpu", "mkl", never) == ("mkl", "mkl GEMMs (asked)")
    # bf16: oneDNN where it runs and bf16 is native, never measured; MKL packs fp32 only
    monkeypatch.setattr(machine, "packed_bf16_runs", lambda: True)
    assert machine.layouts_here(torch.bfloat16, "cpu") == ["stock", "onednn"]
    # AVX2: no native bf16
    assert machine.choose_layout(torch.bfloat16, "cpu", "auto", never)[0] == "stock"
    play_cpu(monkeypatch, *CPUS["avx512-bf16"][0])
    assert machine.choose_layout(torch.bfloat16, "cpu", "auto", never)[0] == "onednn"
    # asked for what this machine cannot run: one line naming what is missing
    monkeypatch.setattr(machine, "packed_bf16_runs", lambda: False)
    with pytest.raises(
        UsageError, match="needs AVX-512 \\(avx512bw, avx512vl, avx512dq\\) or AVX-NE-CONVERT"
    ):
        machine.choose_layout(torch.bfloat16, "cpu", "onednn", never)
    with pytest.raises(
        UsageError, match="onednn: only for fp32 or bf16 targets on the CPU, not torch.float16"
    ):
        machine.choose_layout(torch.float16, "cpu", "onednn", never)
    with pytest.raises(
        UsageError, match="mkl: only for fp32 targets on the CPU, not torch.bfloat16 on cpu"
    ):
        machine.choose_layout(torch.bfloat16, "cpu", "mkl", never)
    # a torch without MKL (ARM)
    monkeypatch.setattr(machine, "mkl_packs_run", lambda: False)
    assert machine.layouts_here(torch.float32, "cpu") == ["stock", "onednn"]
    with pytest.raises(UsageError, match="--target-gemm mkl: this torch has no MKL"):
        machine.choose_layout(torch.float32, "cpu", "mkl", never)


def test_packed_bf16_probe_agrees_with_the_kernel():
    """packed_bf16_runs asks oneDNN itself: true exactly where a packed bf16 linear runs."""
    try:
        PackedLinear(torch.nn.Linear(4, 3).bfloat16())(torch.randn(2, 4, dtype=torch.bfloat16))
        runs = True
    except RuntimeError:
        runs = False
    assert machine.packed_bf16_runs() == runs


def test_machine_cache_measures_once_per_machine_and_what(monkeypatch, tmp_path):
    monkeypatch.setattr(machine, "cache_path", lambda: str(tmp_path / "c" / "machine.json"))
    calls = []
    measure = lambda: calls.append(1) or {"stock": {"1": 2.0}}
    key = machine.machine_key("decode", "t")
    assert key != machine.machine_key("decode", "u") and "threads" in key
    assert machine.cached(key, measure) == {"stock": {"1": 2.0}} and len(calls) == 1
    assert machine.cached(key, measure) == {"stock": {"1": 2.0}} and len(calls) == 1  # read back
    machine.cached(machine.machine_key("decode", "u"), measure)
    assert len(calls) == 2 and len(json.loads((tmp_path / "c" / "machine.json").read_text())) == 2
    # measured again
    (tmp_path / "c" / "machine.json").write_text("{broken")
    assert machine.cached(key, measure) == {"stock": {"1": 2.0}} and len(calls) == 3


def test_decoding_layouts_speculate_and_decode_plainly_each_in_their_faster_layout(monkeypatch):
    play_cpu(monkeypatch, *CPUS["avx2"][0])
    monkeypatch.setattr(machine, "mkl_packs_run", lambda: True)
    target, draft, sizes = tiny_target("llama"), tiny_draft(3), [1, 2, 3]
    stock, onednn, mkl = (
        {n: a + b * n for n in sizes} for a, b in ((75.0, 5), (86.0, 2), (82.0, 4))
    )
    measured = []
    monkeypatch.setattr(
        cost,
        "decode_table",
        lambda t, sizes: measured.append(sizes) or {"stock": stock, "onednn": onednn, "mkl": mkl},
    )
    # verifies of 2 and 3 tokens: 85 + 90 = 175 ms stock against 182 onednn and 184 mkl; a step 80 /
    # 88 / 86
    layouts = cost.decoding_layouts(target, draft, "auto")
    assert (layouts["speculate"], layouts["plain"]) == ("stock", "stock")
    assert layouts["why"].endswith("; plain decoding stock (stock 80.0, onednn 88.0, mkl 86.0 ms)")
    # now 185 ms stock: onednn
    stock.update({3: 100.0})
    layouts = cost.decoding_layouts(target, draft, "auto")
    assert (layouts["speculate"], layouts["plain"]) == ("onednn", "stock") and layout_of(
        target
    ) == "onednn"
    mkl.update({3: 80.0})  # now 170 ms mkl
    layouts = cost.decoding_layouts(target, draft, "auto")
    assert (layouts["speculate"], layouts["plain"]) == ("mkl", "stock")
    # left in the speculation's layout
    assert layout_of(target) == "mkl"
    # the table measured: a plain step and every path's verify, 1..B tokens
    assert measured == [[1, 2, 3]] * 3
    # asked: nothing measured
    asked = cost.decoding_layouts(tiny_target("llama"), draft, "stock")
    assert (
        asked["table"] is None
        and asked["speculate"] == "stock"
        and asked["why"] == "stock GEMMs (asked)"
    )


def test_every_script_asks_the_machine_rule_for_its_dtypes(monkeypatch, tmp_path):
    play_cpu(monkeypatch, *CPUS["avx512-bf16"][0])
    asked = []

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
    data_dtype = torch.bfloat16
    decode = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    assert asked == [data_dtype, decode, data_dtype, torch.float16]


# ==================================================================== speed/gemm.py: packed weights
@pytest.mark.parametrize(
    "dtype,tol",
    [
        (torch.float32, 1e-5),
        pytest.param(
            torch.bfloat16,
            2e-2,
            marks=pytest.mark.skipif(
                not machine.packed_bf16_runs(),
                reason="oneDNN's packed bf16 GEMM needs avx512bw/vl/dq or avx_ne_convert",
            ),
        ),
    ],
)
def test_packed_linear_equals_linear(dtype, tol):
    torch.manual_seed(0)
    for bias in (False, True):
        lin = torch.nn.Linear(24, 40, bias=bias).to(dtype)
        packed = PackedLinear(lin)
        assert packed.weight is lin.weight  # the dense weight stays readable
        for x in (
            torch.randn(1, 1, 24),
            torch.randn(1, 8, 24),
            torch.randn(2, 3, 24),
            torch.randn(24, 5).T,
        ):
            x = x.to(dtype)  # the last one is not contiguous
            want = x.float() @ lin.weight.float().T + (lin.bias.float() if bias else 0)
            got = packed(x)
            assert got.dtype == dtype and got.shape == want.shape
            assert torch.allclose(got.float(), want, atol=tol, rtol=tol)


def test_pack_linears_swaps_every_linear_and_keeps_the_logits():
    target, ids = tiny_target("llama"), torch.randint(0, 64, (1, 11))
    n_linear = sum(isinstance(m, torch.nn.Linear) for m in target.modules())
    head = target.get_output_embeddings().weight
    with torch.no_grad():
        want = target(input_ids=ids).logits
        pack_linears(target)
        got = target(input_ids=ids).logits
    assert (
        n_linear == 4 * 7 + 1
        and sum(isinstance(m, PackedLinear) for m in target.modules()) == n_linear
    )
    assert not any(isinstance(m, torch.nn.Linear) for m in target.modules())
    assert target.get_output_embeddings().weight is head
    assert torch.allclose(got, want, atol=1e-5)
    assert not packable("onednn", torch.float16, "cpu") and not packable(
        "mkl", torch.bfloat16, "cpu"
    )
    assert packable("onednn", torch.bfloat16, "cpu") and not packable("mkl", torch.float32, "cuda")
    with pytest.raises(
        UsageError, match="--target-gemm onednn: only for fp32 or bf16 targets on the CPU"
    ):
        pack_linears(tiny_target("llama").half())
    with pytest.raises(
        UsageError, match="--target-gemm mkl: only for fp32 targets on the CPU, not torch.bfloat16"
    ):
        pack_linears(tiny_target("llama").bfloat16(), "mkl")


@needs_mkl
def test_mkl_linear_packs_once_per_row_count_and_equals_linear():
    """MklLinear: the weight packed for each row count the first time it comes, reused after, and
    the product exact up to fp32 rounding in any summation order: |error| <= K eps (|x| |W|^T + |b|)
    for K = 24 terms; more than MAX_ROWS rows (prefill) take the stock GEMM and pack nothing."""
    torch.manual_seed(0)
    for bias in (False, True):
        lin = torch.nn.Linear(24, 40, bias=bias)
        mkl = MklLinear(lin)
        assert mkl.weight is lin.weight and mkl.packs == {}
        for x in (
            torch.randn(1, 1, 24),
            torch.randn(1, 8, 24),
            torch.randn(2, 3, 24),
            torch.randn(24, 5).T,
            torch.randn(1, MklLinear.MAX_ROWS + 1, 24),
        ):
            want = x.double() @ lin.weight.double().T + (lin.bias.double() if bias else 0)
            scale = x.double().abs() @ lin.weight.double().abs().T + (
                lin.bias.double().abs() if bias else 0
            )
            got = mkl(x)
            assert got.dtype == torch.float32 and got.shape == want.shape
            assert (
                (got.double() - want).abs() <= 24 * torch.finfo(torch.float32).eps * scale
            ).all()
        assert sorted(mkl.packs) == [1, 5, 6, 8]  # 1, 8, 2 x 3 and 5 rows; not 65
        pack = mkl.packs[6]
        mkl(torch.randn(6, 24))
        assert mkl.packs[6] is pack  # packed once


@needs_mkl
def test_set_layout_switches_layouts_and_keeps_the_mkl_packs():
    """set_layout moves the target between stock, oneDNN and MKL linears with the same logits, and
    coming back to MKL reuses the modules packed before (bench.py switches per prompt; packing is
    not what it times)."""
    target, ids = tiny_target("llama"), torch.randint(0, 64, (1, 11))
    mkl_modules = lambda: [m for m in target.modules() if isinstance(m, MklLinear)]
    first = None
    with torch.no_grad():
        want = target(input_ids=ids).logits
        for layout in ("mkl", "onednn", "stock", "mkl"):
            set_layout(target, layout)
            # back: the same modules, packed for 5 rows already
            if first is not None and layout == "mkl":
                assert mkl_modules() == first and all(list(m.packs) == [5] for m in first)
            got = target(input_ids=ids[:, :5]).logits
            assert layout_of(target) == layout and torch.allclose(got, want[:, :5], atol=1e-5)
            first = first or mkl_modules()
        assert len(first) == 4 * 7 + 1
        set_layout(target, "stock")
    assert not any(isinstance(m, (MklLinear, PackedLinear)) for m in target.modules())


def test_unpack_linears_undoes_pack_linears():
    target, ids = tiny_target("llama"), torch.randint(0, 64, (1, 11))
    weights = {k: v for k, v in target.state_dict().items()}
    with torch.no_grad():
        want = target(input_ids=ids).logits
        # onednn, and mkl where it runs
        for layout in machine.layouts_here(torch.float32, "cpu")[1:]:
            unpack_linears(pack_linears(target, layout))
        got = target(input_ids=ids).logits
    assert not any(isinstance(m, (PackedLinear, MklLinear)) for m in target.modules())
    assert all(
        target.state_dict()[k] is v or torch.equal(target.state_dict()[k], v)
        for k, v in weights.items()
    )
    assert torch.equal(got, want)


# ============================================================================ speed/cost.py
def test_cost_tables_measure_every_layout_and_leave_the_target_stock(monkeypatch, tmp_path):
    monkeypatch.setattr(machine, "cache_path", lambda: str(tmp_path / "machine.json"))
    monkeypatch.setattr(machine, "mkl_packs_run", lambda: True)
    target, seen, extra = tiny_target("llama"), [], {"stock": 0.0, "onednn": 5.0, "mkl": 2.0}
    monkeypatch.setattr(
        cost,
        "target_ms",
        lambda t, context, n, repeats, rows=1: (
            seen.append((layout_of(t), n, rows)) or 10.0 + n + extra[seen[-1][0]]
        ),
    )
    table = cost.decode_table(target, (1, 8))
    assert table == {
        "stock": {1: 11.0, 8: 18.0},
        "onednn": {1: 16.0, 8: 23.0},
        "mkl": {1: 13.0, 8: 20.0},
    }
    assert seen == [(layout, n, 1) for layout in ("stock", "onednn", "mkl") for n in (1, 8)]
    assert cost.decode_table(target, (1, 8)) == table and len(seen) == 6  # cached
    assert cost.fastest(table, 1) == "stock"
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
    # one step per call, over all of x
    a = (x.clamp_min(0).max() - x.clamp_max(0).min()) / 127
    # [6, 40]
    bound = s / 2 * flat.abs().sum(1, keepdim=True) + a / 2 * (q.float() * s[:, None]).abs().sum(1)
    err = (y.reshape(-1, 40) - flat @ w.T).abs()
    assert y.shape == (2, 3, 40) and y.dtype == torch.float32
    # within the bound, and really int8
    assert (err <= bound * 1.001 + 1e-5).all() and err.max() > 1e-4


@needs_int8
def test_int8_draft_keeps_fc_in_fp32_and_its_head_in_int8():
    target, draft = tiny_target("qwen3"), tiny_draft(4)
    ref = draft.state_dict()
    head = int8.quantize(draft, target.get_output_embeddings().weight)
    linears = {
        n: type(m)
        for n, m in draft.named_modules()
        if isinstance(m, (torch.nn.Linear, int8.Int8Linear))
    }
    assert linears.pop("fc") is torch.nn.Linear and set(linears.values()) == {int8.Int8Linear}
    assert torch.equal(draft.fc.weight, ref["fc.weight"]) and isinstance(head, int8.Int8Linear)
    # every layer's projections, the convolutions' kernel projections and the selector's P are int8
    names = {n.rsplit(".", 1)[-1] for n in linears}
    assert {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
        "kernel_projection",
        "hidden_projection",
    } <= names


# ============================================================================ speed/tune.py
def test_head_rows_takes_the_fastest_row_count_that_covers_the_slots():
    """B = 5: the head timed over r = 2..5 rows; slots 1..L need r >= L + 1, the fastest such r is
    taken (ties: the fewer rows). Like bf16 on an AMX Xeon, where the full block was the cheapest of
    all."""
    assert cost.fastest_rows({2: 3.0, 3: 2.5, 4: 9.0, 5: 8.0}, 5) == {1: 3, 2: 3, 3: 5, 4: 5}
    assert cost.fastest_rows({2: 100.0, 3: 95.0, 4: 94.0, 5: 13.0}, 5) == {1: 5, 2: 5, 3: 5, 4: 5}
    assert cost.fastest_rows({2: 1.0, 3: 1.0, 4: 1.0, 5: 1.0}, 5) == {1: 2, 2: 3, 3: 4, 4: 5}


def test_verify_shapes_are_the_shapes_asked_and_a_path_fits_the_block():
    """--verify-tokens k: a path of k drafts, k at most B-1 (the drafts a cycle proposes); more is
    refused in one line. --tree-budget n: a tree of n nodes. Paths first, each in the order
    given."""
    flags = ["--tree-budget", "8", "--verify-tokens", "2", "7", "--bench", "gsm8k"]
    args = generate.parse_args(["--draft", "d", *flags])
    assert tune.choose(args, 8)[2] == [("path", 2), ("path", 7), ("tree", 8)]
    with pytest.raises(UsageError, match=r"--verify-tokens: at most 2, .*\(block size 3\)"):
        tune.choose(args, 3)
    with pytest.raises(UsageError, match="at most 7"):  # B drafts: one more than a cycle proposes
        tune.choose(generate.parse_args(["--draft", "d", "--verify-tokens", "8"]), 8)
    # the default: the path of B-1; --fast's: a tree of FAST_TREE nodes
    for flags, shape in (([], ("path", 7)), (["--fast"], ("tree", tune.FAST_TREE))):
        assert tune.choose(generate.parse_args(["--draft", "d", *flags]), 8)[2] == [shape]
    with pytest.raises(SystemExit):  # auto is no value any more
        generate.parse_args(["--draft", "d", "--tree-budget", "auto"])
