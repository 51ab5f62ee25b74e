"""docs/scaling-out.md and docs/architecture.md stay true to the code, on the CPU.

The Python snippets of scaling-out.md run (the GPU-only one with its NCCL and `.cuda()`
lines taken out, as the one-process layer), the plan prints what the doc shows, the
documented signatures are the real ones, the cost model's bytes are the plan's, the
exchange orders and the determinism claims hold, bad arguments are refused with a
clear error before any work, and architecture.md's import lists are what each part of
the package imports.
"""

from __future__ import annotations

import ast as pyast
import contextlib
import inspect
import io
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from ep_cases import DECODE_SPEC, SPEC  # noqa: E402

import gemmspec.ep as ep  # noqa: E402
from gemmspec.errors import ArgumentError, GemmspecError  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SCALING = (ROOT / "docs" / "scaling-out.md").read_text(encoding="utf-8")
ARCHITECTURE = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
TRAIN_EXAMPLE = ROOT / "examples" / "moe_ffn_fp8_train.gspec"


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def _blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced block, in order."""
    return re.findall(r"^```(\w*)\n(.*?)^```", text, re.M | re.S)


@pytest.fixture(scope="module")
def layer_parts():
    """A one-process ExpertParallel of the small training spec, its full weights and a
    routing of 6 tokens, k = 2."""
    layer = ep.ExpertParallel(SPEC)
    full = ep.EPMoE.full_weights(layer.plan.roles)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 128, generator=gen)
    idx = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(6)])
    w = torch.rand(6, 2, generator=gen)
    return layer, {n: full[n] for n in layer.roles.weights}, x, idx, w


# ---- the snippets ------------------------------------------------------------------------
def test_the_plan_snippet_prints_what_the_doc_shows(monkeypatch):
    blocks = _blocks(SCALING)
    i = next(i for i, (lang, body) in enumerate(blocks) if lang == "python" and "ep.plan(" in body)
    code, shown = blocks[i][1], blocks[i + 1][1]
    monkeypatch.chdir(ROOT)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "scaling-out.md", "exec"), {})
    printed = out.getvalue().splitlines()
    lines = [line for line in shown.splitlines() if line.strip() != "..."]
    assert len(lines) >= 5
    for line in lines:
        head = line[: -len(" ...")] if line.endswith(" ...") else line
        assert any(p == line or (head != line and p.startswith(head)) for p in printed), line


def test_the_running_snippet_runs_as_the_one_process_layer():
    # The snippet is for NCCL and CUDA tensors; without its process group and `.cuda()`
    # it is the same layer on one process (Exchange with no group initialized).
    (code,) = [body for lang, body in _blocks(SCALING) if lang == "python" and "EPMoE(" in body]
    assert 'init_process_group("nccl")' in code and ".cuda()" in code
    cpu = "\n".join(line for line in code.splitlines() if "init_process_group" not in line)
    cpu = cpu.replace(".cuda()", "")
    x = torch.randn(5, 128)
    scope = {"spec": SPEC, "x": x, "grad": torch.randn(5, 128)}
    exec(compile(cpu, "scaling-out.md", "exec"), scope)
    layer, out = scope["layer"], scope["out"]
    assert out.shape == x.shape
    assert layer.router.grad is not None and layer.router.grad.shape == (8, 128)
    assert all(getattr(layer, w).grad is not None for w in layer.ep.roles.weights)


def test_every_python_snippet_is_one_of_those_two():
    bodies = [body for lang, body in _blocks(SCALING) + _blocks(ARCHITECTURE) if lang == "python"]
    assert len(bodies) == 2
    assert sum("ep.plan(" in b for b in bodies) == 1 and sum("EPMoE(" in b for b in bodies) == 1


def test_the_spec_statements_shown_are_the_examples():
    (shown,) = [body for lang, body in _blocks(SCALING) if lang == "" and "w_up[expert(t)" in body]
    for name in ("moe_ffn_fp8.gspec", "moe_ffn_fp8_train.gspec"):
        text = (ROOT / "examples" / name).read_text()
        for line in shown.strip().splitlines():
            assert line in text, (name, line)
    for text in (SPEC, DECODE_SPEC):
        roles = ep.plan(text, 1).roles
        assert (roles.tokens, roles.gather, roles.output, roles.scatter, roles.route_weight) == \
            ("x", "src", "y", "dst", "route_w")
        assert roles.weights == ("w_up", "w_down")


# ---- signatures ----------------------------------------------------------------------------
def _documented(call: str) -> tuple[str, str]:
    """The first `NAME(...)` code span of scaling-out.md that starts with `call`."""
    m = re.search(r"`" + re.escape(call) + r"\(([^`]*)\)`", _flat(SCALING))
    assert m, f"scaling-out.md documents no `{call}(...)`"
    return call, m.group(1)


def _check_signature(fn, documented: str, *, complete: bool, skip_self: bool = False) -> None:
    params = list(inspect.signature(fn).parameters.values())[1 if skip_self else 0:]
    keyword_only = False
    seen = []
    for part in (p.strip() for p in documented.split(",")):
        if part == "*":
            keyword_only = True
            continue
        name, _, value = part.partition("=")
        name = name.strip()
        real = next((p for p in params if p.name == name), None)
        assert real is not None, f"{fn.__qualname__} has no parameter {name!r}"
        assert (real.kind is inspect.Parameter.KEYWORD_ONLY) == keyword_only, (fn.__qualname__, name)
        if not keyword_only:
            assert params.index(real) == len(seen), (fn.__qualname__, name, "position")
        if value:
            try:
                literal = pyast.literal_eval(value.strip())
            except ValueError:  # a placeholder (tokens=S), not a default
                literal = inspect.Parameter.empty
            if literal is not inspect.Parameter.empty:
                assert real.default == literal, (fn.__qualname__, name, real.default)
        elif keyword_only:
            assert real.default is inspect.Parameter.empty, (fn.__qualname__, name, "has a default")
        seen.append(name)
    if complete:
        assert seen == [p.name for p in params], fn.__qualname__


def test_documented_signatures_are_the_real_ones():
    from gemmspec.ep.layer import EPMoEDecode, ExpertParallel

    for call, fn in (("gemmspec.ep.plan", ep.plan), ("ExpertParallel", ExpertParallel),
                     ("EPMoE", ep.EPMoE), ("EPMoEDecode", EPMoEDecode)):
        _check_signature(fn, _documented(call)[1], complete=True)
    _check_signature(ExpertParallel.__call__, _documented("ep")[1], complete=True, skip_self=True)
    _check_signature(EPMoEDecode.decode, _documented("decode")[1], complete=True, skip_self=True)
    _check_signature(EPMoEDecode.load, _documented("load")[1], complete=True, skip_self=True)
    _check_signature(ep.Placement, _documented("Placement")[1], complete=True)
    _check_signature(ep.Placement.contiguous, "experts, world", complete=True)
    assert "Placement.contiguous(E, world)" in _flat(SCALING)
    with pytest.raises(TypeError):  # capacity is keyword-only, as documented
        ep.plan(SPEC, 1, None, True)


def test_the_attributes_the_doc_names_exist(layer_parts):
    layer = layer_parts[0]
    assert isinstance(layer.plan, ep.EPPlan)
    assert layer.experts == range(0, 8)
    assert layer.exchange.bytes_sent == 0  # one process: nothing sent to another rank
    assert layer.phases is None  # set to {} to time each phase
    assert ep.SINGLE is ep.SINGLE and repr(ep.SINGLE) == "gemmspec.ep.SINGLE"
    assert layer.plan.ranks[0].weight_shapes == (("w_up", (8, 256, 128)), ("w_down", (8, 128, 128)))


# ---- the plan and the cost model ---------------------------------------------------------------
def test_cost_model_table_is_the_plans_bytes():
    p = ep.plan(TRAIN_EXAMPLE, 4)
    table = re.search(r"\| exchange \| bytes per routed row \|\n\|[-|]+\|\n((?:\|.*\|\n)+)", SCALING)
    assert table
    rows = {cells[0]: int(cells[1].split("=")[-1]) for cells in
            ([c.strip() for c in line.strip("|").split("|")] for line in table.group(1).splitlines())}
    got = dict(zip(rows, (p.dispatch_bytes, p.combine_bytes, *p.backward_bytes)))
    assert rows == got
    assert f"8 × {p.dispatch_bytes + p.combine_bytes}" in SCALING
    assert "7168 + 224 + 4 = 7396" in SCALING and p.roles.row_bytes("x") == 7168 + 224


def test_a_ranks_local_spec_changes_only_the_expert_count():
    from gemmspec.check import check

    p = ep.plan(TRAIN_EXAMPLE, 4, ep.Placement((1, 3, 2, 2)))
    assert [list(r.experts) for r in p.ranks] == [[0], [1, 2, 3], [4, 5], [6, 7]]
    whole = p.roles.spec
    for r in p.ranks:
        (local,) = check(r.file)
        assert local.group("expert").count == len(r.experts)
        assert [(d.name, d.size) for d in local.dims if d.name != "E"] == \
            [(d.name, d.size) for d in whole.dims if d.name != "E"]
        assert [t.name for t in local.tensors] == [t.name for t in whole.tensors]
    explained = p.ranks[1].build().explain()
    assert "expert[E=3]" in explained and "backward" in explained


def test_the_plan_needs_no_torch():
    code = textwrap.dedent(f"""
        import sys
        sys.modules["torch"] = None
        import gemmspec.ep as ep
        p = ep.plan({str(ROOT / "examples" / "moe_ffn_fp8.gspec")!r}, 2)
        assert p.ranks[1].weight_shapes[0] == ("w_up", (4, 4096, 7168))
        try:
            ep.EPMoE
        except ImportError:
            print("layers need torch")
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "layers need torch"


# ---- what is exchanged ----------------------------------------------------------------------
def test_send_order_is_by_expert_then_token_then_slot():
    from gemmspec.ep.exchange import route

    idx = torch.tensor([[2, 0], [0, 2], [1, 0], [2, 2]])
    r = route(idx, 4)
    flat = idx.reshape(-1).tolist()
    assert r.order.tolist() == sorted(range(8), key=lambda i: (flat[i], i))  # i = s*k + c
    assert r.token.tolist() == [i // 2 for i in r.order.tolist()]
    assert r.expert_counts.tolist() == [3, 1, 4, 0]
    assert r.pos[r.order].tolist() == list(range(8))


def test_received_rows_are_read_in_expert_order_through_one_index():
    from gemmspec.ep.exchange import local_rows

    # From rank 0: 1 row of local expert 0, 2 of expert 1; from rank 1: 3 of expert 0.
    counts = torch.tensor([[1, 2], [3, 0]])
    perm, offsets = local_rows(counts, 6)
    # Received order: r0e0 (row 0), r0e1 (rows 1, 2), r1e0 (rows 3-5).
    assert perm.tolist() == [0, 3, 4, 5, 1, 2] and perm.dtype == torch.int32
    assert offsets.tolist() == [0, 4, 6] and offsets.dtype == torch.int32


def test_the_combine_adds_a_tokens_rows_in_slot_order_in_f32():
    from gemmspec.ep.exchange import sum_slots

    # One token, k = 3: slots 0, 1, 2 hold 2^-30, 1 and -1 and sit at send positions 2, 0, 1.
    rows = torch.tensor([[1.0], [-1.0], [2.0**-30]], dtype=torch.float64)
    out = sum_slots(rows, torch.tensor([2, 0, 1]), 3)
    assert out.dtype == torch.float32
    # Slot order in f32: (2^-30 + 1) rounds to 1, minus 1 is 0 (send order would give 2^-30).
    assert out.tolist() == [[0.0]]


def test_one_process_passes_rows_back_as_given():
    from gemmspec.ep.exchange import Exchange

    for group in (None, ep.SINGLE):  # no process group initialized / this process alone
        ex = Exchange(group)
        assert (ex.world, ex.rank) == (1, 0)
        rows = torch.randn(3, 4)
        got, work = ex.rows(rows, [3], [3], async_op=True)
        assert got is rows and work is None and ex.bytes_sent == 0


def test_chunks_change_only_weight_gradients_and_runs_repeat_bit_for_bit(layer_parts):
    _, weights, x0, idx, w0 = layer_parts
    grad = torch.randn(6, 128, generator=torch.Generator().manual_seed(4))
    runs = []
    for chunks in (1, 3, 3):
        layer = ep.ExpertParallel(SPEC, chunks=chunks)
        x, w = x0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
        ws = {n: v.clone().requires_grad_(True) for n, v in weights.items()}
        out = layer(x, idx, w, ws)
        out.backward(grad)
        runs.append([out.detach(), x.grad, w.grad, *(ws[n].grad for n in weights)])
    one, chunked, again = runs
    for a, b in zip(chunked, again):  # the same inputs, the same bits
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    for a, b in zip(one[:3], chunked[:3]):  # output, token and router weight gradients
        assert torch.equal(a, b)
    assert any(not torch.equal(a, b) for a, b in zip(one[3:], chunked[3:]))  # weight gradients
    for a, b in zip(one[3:], chunked[3:]):
        assert torch.allclose(a, b, rtol=0.1, atol=0.1 * float(a.abs().max()))


# ---- bad arguments ----------------------------------------------------------------------------
@pytest.fixture
def no_work(monkeypatch):
    """Any routing or exchange fails the test: an error must come before them."""
    import gemmspec.ep.layer as layer_module

    def fail(*args, **kwargs):
        raise AssertionError("work began before the arguments were checked")

    monkeypatch.setattr(layer_module, "route", fail)
    monkeypatch.setattr(layer_module._EPFunction, "apply", fail)


def test_expert_parallel_refuses_bad_arguments_before_any_work(layer_parts, no_work):
    layer, weights, x, idx, w = layer_parts
    bad = [
        (torch.randn(6, 64), idx, w, weights, "x is [6, 64]"),
        (x[0], idx, w, weights, "x is [128]"),
        (x, idx[:, 0], w[:, 0], weights, "topk_idx is [6]"),
        (x, idx[:4], w[:4], weights, "topk_idx is [4, 2]"),
        (x, idx[:, :0], w[:, :0], weights, "topk_idx is [6, 0]"),
        (x, idx, w[:, :1], weights, "topk_w is [6, 1]"),
        (x, idx.float(), w, weights, "topk_idx is torch.float32"),
        (x, idx, w, {"w_up": weights["w_up"]}, "w_down missing"),
        (x, idx, w, {**weights, "w_up": weights["w_up"][:4]}, "w_up is [4, 256, 128], not [8, 256, 128]"),
    ]
    for args in bad:
        with pytest.raises(ArgumentError, match=re.escape(args[-1])):
            layer(*args[:-1])


@pytest.mark.parametrize("chunks", [0, -1, 2.0, True])
def test_chunks_must_be_a_positive_int(chunks):
    with pytest.raises(ArgumentError, match="chunks must be an int >= 1"):
        ep.ExpertParallel(SPEC, chunks=chunks)


def test_epmoe_refuses_a_top_k_outside_one_to_e():
    for k in (0, 2.0):
        with pytest.raises(ArgumentError, match="top_k must be an int >= 1"):
            ep.EPMoE(SPEC, top_k=k)
    with pytest.raises(ArgumentError, match="top_k = 9 is more than the spec's 8 experts"):
        ep.EPMoE(SPEC, top_k=9)


def test_decode_refuses_bad_arguments_before_any_work(monkeypatch):
    for kwargs, message in (({"tokens": -1}, "tokens must be an int >= 0"), ({"top_k": 0}, "top_k must be"),
                            ({"capacity": -1}, "capacity must be an int >= 0")):
        with pytest.raises(ArgumentError, match=message):
            ep.EPMoEDecode(DECODE_SPEC, **{"tokens": 4, "top_k": 2, **kwargs})
    layer = ep.EPMoEDecode(DECODE_SPEC, tokens=4, top_k=2)
    x, idx, w = torch.randn(4, 128), torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7]]), torch.rand(4, 2)
    with pytest.raises(ArgumentError, match="call load"):
        layer.decode(x, idx, w)
    full = ep.EPMoE.full_weights(layer.plan.roles)
    with pytest.raises(ArgumentError, match="w_down missing"):
        layer.load({"w_up": full["w_up"]})
    with pytest.raises(ArgumentError, match=re.escape("w_up is [4, 256, 128], not [8, 256, 128]")):
        layer.load({"w_up": full["w_up"][:4], "w_down": full["w_down"]})
    layer.load(full)
    import gemmspec.ep.layer as layer_module

    monkeypatch.setattr(layer_module, "route", lambda *a: pytest.fail("work began before the check"))
    for args, message in (((x, idx, torch.rand(4, 3)), "topk_w is [4, 3]"), ((x[:, :64], idx, w), "x is [4, 64]"),
                          ((x, idx[:3], w[:3]), "topk_idx is [3, 2]"), ((x[:3], idx, w), "x is [3, 128]")):
        with pytest.raises(ArgumentError, match=re.escape(message)):
            layer.decode(*args)


def test_placement_and_plan_refuse_bad_arguments():
    assert ep.Placement([2, 2]) == ep.Placement((2, 2))
    assert ep.Placement((2, 6)).sizes == (2, 6) and str(ep.Placement((1, 3))) == "rank 0: experts 0, rank 1: experts 1-3"
    for sizes in (4, (), (2, 0), (2.0, 2)):
        with pytest.raises(GemmspecError, match="placement"):
            ep.Placement(sizes)
    with pytest.raises(GemmspecError, match="do not split evenly over 3 ranks"):
        ep.plan(SPEC, 3)
    for world in (0, "2", 2.0):
        with pytest.raises(GemmspecError, match="world_size must be an int >= 1"):
            ep.plan(SPEC, world)
    with pytest.raises(GemmspecError, match="placement must be a Placement"):
        ep.plan(SPEC, 2, [4, 4])
    with pytest.raises(GemmspecError, match=re.escape("placement [4, 4] is for 2 ranks and 8 experts")):
        ep.plan(SPEC, 4, ep.Placement((4, 4)))
    with pytest.raises(GemmspecError, match="expert parallelism needs an expert FFN spec"):
        ep.plan(ROOT / "examples" / "moe_fp8_forward.gspec", 2)


def test_decode_refuses_the_training_spec():
    # A copy such as h_t cannot be written over a capacity group: the local spec fails to check.
    with pytest.raises(GemmspecError, match="capacity"):
        ep.EPMoEDecode(SPEC, tokens=4, top_k=2)


# ---- architecture.md: what each part imports --------------------------------------------------------
def _rooms() -> dict[str, set[str]]:
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        import test_import_layers as layers
    finally:
        sys.path.remove(str(ROOT / "tests"))
    graph = layers._package_graph(layers._graph())
    return {room.removeprefix("gemmspec."): {t.removeprefix("gemmspec.") for t in targets}
            for room, targets in graph.items()}


# Each part's import list as architecture.md words it, and the part it is of.
IMPORT_CLAIMS = {
    "spec": "which imports `errors` and `expr`",
    "parse": "Imports `ast`, `errors`, `diskcache`.",
    "check": "Imports `ast`, `spec`, `expr`, `aliasing`, `tiling`, `errors`, and `parse` for the spans of fixes.",
    "analyse": "Imports `spec`, `tiling`, `gather_plan`, `errors` (",
    "gather_plan": "(`gather_plan` imports `spec` and `expr`)",
    "lower": "(`lower/lowering.py`). Imports `analyse`, `spec`, `expr`, `errors`.",
    "codegen": "the wgmma instruction of a kernel. Imports `lower`, `spec`, `expr`, `errors`.",
    "runtime": "Imports `codegen`, `lower`, `analyse`, `reference`, `aliasing`, `diskcache`, `spec`, `errors`;",
    "reference": "the CPU tests prove. Imports `analyse`, `lower`, `spec`, `errors`.",
    "backward": "Imports `spec` only",
    "explain": "imports `codegen`, `lower`, `backward`, `spec`, `errors`, and `pipeline`",
    "pipeline": "`pipeline` imports `parse`, `check`, `gather_plan`, `analyse`, `lower`, `backward`, `ast`, `spec`;",
    "build": "`build` imports `pipeline`, `codegen`, `runtime`, `backward`, `explain`, `ast`, `spec`, `errors`.",
    "output": "Imports `pipeline`, `codegen`, `explain`, `lower`, `spec`, `ast`, `errors`, and `runtime` for cubins.",
    "torch": "Imports `build`, `runtime`, `codegen`, `ast`, `errors`.",
    "torch_reference": "`torch_reference` imports `torch` and `reference`",
    "ep": "`ep` imports `torch`, `torch_reference`, `check`, `parse`, `pipeline`, `backward`, `build`, `ast`, "
          "`spec`, `errors`;",
    "tune": "Imports `build`, `pipeline`, `parse`, `runtime`, `codegen`, `analyse`, `tiling`, `errors`.",
    "bench": "Imports `arguments`, `build`, `clocks`, `output` (the output paths' checks), `runtime` (the result's judge, "
             "the GPU check) and `errors`;",
}


def test_architecture_import_lists_are_what_each_part_imports():
    rooms, doc = _rooms(), _flat(ARCHITECTURE)
    for room, claim in IMPORT_CLAIMS.items():
        assert claim in doc, f"architecture.md no longer says: {claim}"
        named = set(re.findall(r"`(\w+)`", claim)) - {room}
        assert named == rooms[room], (room, sorted(rooms[room]))
    assert "it does not import `explain` or `build`" in doc
    # The shared modules at the bottom import nothing of the package but each other.
    bottom = {"errors", "expr", "aliasing", "tiling", "diskcache", "clocks", "ast"}
    assert all(rooms[m] <= bottom for m in bottom)
    # Nothing imports the cli but __main__.py; nothing below explain imports it.
    assert {r for r, t in rooms.items() if "cli" in t} == {"__main__"}
    assert {r for r, t in rooms.items() if "explain" in t} == {"build", "output", "cli"}


def test_the_stages_import_only_earlier_stages():
    assert "parse -> check -> analyse -> lower -> codegen -> runtime" in ARCHITECTURE
    rooms = _rooms()
    stages = ["parse", "check", "analyse", "lower", "codegen", "runtime"]
    for i, stage in enumerate(stages):
        assert not rooms[stage] & set(stages[i + 1:]), stage


def test_torch_is_imported_at_the_top_only_where_the_doc_says():
    claim = ("With `torch_reference.py` and `ep/`'s `exchange.py` and `layer.py`, the only modules that "
             "import torch at their top")
    assert claim in _flat(ARCHITECTURE)
    at_top = set()
    for path in (ROOT / "gemmspec").rglob("*.py"):
        for node in pyast.parse(path.read_text(encoding="utf-8")).body:
            names = [a.name for a in node.names] if isinstance(node, pyast.Import) else \
                [node.module or ""] if isinstance(node, pyast.ImportFrom) and not node.level else []
            if any(n == "torch" or n.startswith("torch.") for n in names):
                at_top.add(path.relative_to(ROOT / "gemmspec").as_posix())
    assert at_top == {"torch.py", "torch_reference.py", "ep/exchange.py", "ep/layer.py"}
