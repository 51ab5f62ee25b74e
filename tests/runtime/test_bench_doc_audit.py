"""`gemmspec bench` against docs/usage.md and the module docstrings of gemmspec/bench,
without a GPU: the options and their errors (checked before the GPU is looked for),
the exit statuses, the command's run with a stand-in device (the first line, the JSON's
fields, --only, --no-deepgemm, a failed case), the verdicts and shares on each kind of
card, and the case table's names, shapes and targets. Expected values come from the
docs' rules, not from the code under test."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import types

import pytest

from gemmspec import bench
from gemmspec.bench import cases, run, specs, sweep, timing
from gemmspec.bench.anchors import deepgemm
from gemmspec.bench.card import Card
from gemmspec.bench.report import verdict
from gemmspec.cli import main as cli_main
from gemmspec.errors import DeviceUnavailableError

BY_NAME = {c.name: c for c in bench.CASES}
H200 = Card("NVIDIA H200", 4.31)
H100 = Card("NVIDIA H100 80GB HBM3", 3.0)
NO_GPU = 'no usable CUDA device 0 (is an NVIDIA GPU and driver present?): "cuda" not found'


@pytest.fixture(autouse=True)
def _restore_bench_state(monkeypatch):
    """main() sets module state (--tile, --idle, DeepGEMM, the sampler): put it back."""
    monkeypatch.setattr(specs, "FORCED_TILE", specs.FORCED_TILE)
    monkeypatch.setattr(timing, "IDLE_MS", timing.IDLE_MS)
    monkeypatch.setattr(timing, "SAMPLER", timing.SAMPLER)
    monkeypatch.setattr(deepgemm, "DEEPGEMM", deepgemm.DEEPGEMM)


@pytest.fixture
def gpu_never_looked_for(monkeypatch):
    """Fails the test if the command gets as far as the device or torch."""

    def looked(*_):
        raise AssertionError("the GPU was looked for")

    monkeypatch.setattr("gemmspec.runtime.arrays.require_hopper", looked)
    monkeypatch.setattr(run, "load_torch", looked)


@pytest.fixture
def no_gpu(monkeypatch):
    """No device: require_hopper says so; torch must not be loaded after it."""
    looked = []

    def require_hopper(ordinal=0):
        looked.append(ordinal)
        raise DeviceUnavailableError(NO_GPU)

    def load_torch():
        raise AssertionError("torch loaded without a GPU")

    monkeypatch.setattr("gemmspec.runtime.arrays.require_hopper", require_hopper)
    monkeypatch.setattr(run, "load_torch", load_torch)
    return looked


def _usage_error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


# ------------------------------------------------------------------ the command line
def test_help_names_every_option_of_the_commands_table(capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["bench", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: gemmspec bench")
    for option in ("--only CASE", "--repeat N", "--idle MS", "--json FILE", "--plot FILE.png", "--tile MxN",
                   "--list", "--sweep", "--no-deepgemm"):
        assert option in out, option


def test_python_dash_m_is_the_same_command():
    cmd = [sys.executable, "-m", "gemmspec.bench"]
    listed = subprocess.run([*cmd, "--list"], capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0
    assert [line.split()[0] for line in listed.stdout.splitlines()] == list(BY_NAME)
    bad = subprocess.run([*cmd, "--only", "nothing_like_it"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "gemmspec bench: error: --only 'nothing_like_it'" in bad.stderr


def test_list_gives_each_cases_target_needs_no_gpu(gpu_never_looked_for, capsys):
    assert cli_main(["bench", "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(bench.CASES)
    by_case = {line.split()[0]: line for line in lines}
    # Targets as the docs state them, on the H200's 4.2 TB/s (no card is measured).
    assert ">= 85% of 4.2 TB/s, >= 1.30x torch, >= 1.00x DeepGEMM" in by_case["decode_ragged_E8_T128_N4096_K7168"]
    assert ">= 90% of 4.2 TB/s, >= 1.05x DeepGEMM" in by_case["decode_masked_E32xM64_N4096_K7168"]
    assert "faster than separate launches" in by_case["lora_expand_L4xE8_R16_N4096_T8192"]
    assert ">= 1.00x torch" in by_case["ffn_fp8_E8_T32768_H7168_F2048"]


@pytest.mark.parametrize("argv, message", [
    (["--repeat", "0"], "argument --repeat: expected a positive integer, got '0'"),
    (["--repeat", "-3"], "argument --repeat"),
    (["--repeat", "2.5"], "argument --repeat"),
    (["--idle", "-0.5"], "--idle takes milliseconds >= 0, got -0.5"),
    (["--idle", "nan"], "--idle takes milliseconds >= 0, got nan"),
    (["--idle", "inf"], "--idle takes milliseconds >= 0, got inf"),
    (["--idle=-inf"], "--idle takes milliseconds >= 0, got -inf"),
    (["--only"], "argument --only: expected at least one argument"),
    (["--only", ""], "argument --only: expected a case's name or the start of one, got an empty string"),
    (["--only", "   "], "argument --only: expected a case's name"),
    (["--only", "zzz"], "--only 'zzz' matches no case"),
    (["--only", "fp8_fwd", "decode", "fp9"], "--only 'fp9' matches no case"),
    (["--only", "FP8_fwd"], "--only 'FP8_fwd' matches no case"),  # a prefix of the name as written
    (["--tile", "96x128"], "--tile 96x128: not a supported tile"),
    (["--tile", "64x264"], "--tile 64x264: not a supported tile"),
    (["--tile", "64x0"], "--tile 64x0: not a supported tile"),
    (["--tile", "128x12"], "--tile 128x12: not a supported tile"),
    (["--tile", "128"], "--tile expects MxN"),
    (["--tile", "64x64x64"], "--tile expects MxN"),
    (["--json", ""], "argument --json: expected a path, got an empty string"),
    (["--plot", ""], "argument --plot: expected a path, got an empty string"),
    (["--sweep", "decode", "--list"], "--sweep runs one shape over token counts: it takes no --only or --list"),
    (["--tile", ""], "--tile"),
])
def test_bad_options_are_usage_errors_before_the_gpu(argv, message, gpu_never_looked_for, capsys):
    err = _usage_error(argv, capsys)
    assert err.startswith("usage: gemmspec bench")
    (last,) = [line for line in err.splitlines() if line.startswith("gemmspec bench: error: ")]
    assert message in last and err.rstrip().endswith(last)


def test_an_unknown_prefix_error_gives_the_names_first_words(gpu_never_looked_for, capsys):
    err = _usage_error(["--only", "moe"], capsys)
    # The families of usage.md's table: fp8/bf16 GEMMs, LoRA, the FFNs, the decode rows.
    assert "case names start with bf16_, decode_, ffn_, fp8_, lora_" in err
    assert "gemmspec bench --list" in err


def test_the_first_bad_option_of_several_is_reported_once(gpu_never_looked_for, capsys):
    err = _usage_error(["--idle", "-1", "--tile", "1x1", "--only", "zzz"], capsys)
    assert err.count("gemmspec bench: error:") == 1


# ------------------------------------------------------------------ --json and --plot files
def _file_error(argv, capsys, monkeypatch, tmp_path, formats=frozenset({"png", "pdf", "svg"})):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(run, "_plot_formats", lambda: None if formats is None else set(formats))
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert cli_main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing created
    (line,) = err.splitlines()
    assert line.startswith("gemmspec: error: ")
    return line


@pytest.mark.parametrize("argv, named, why", [
    (["--json", "adir"], "adir", "it is a directory"),
    (["--json", "adir/"], "adir/", "it is a directory"),
    (["--plot", "adir"], "adir", "it is a directory"),
    (["--json", "new/"], "new/", "ends in '/'"),
    (["--plot", "new/sub/"], "new/sub/", "ends in '/'"),
    (["--json", "afile/x.json"], "afile", "exists and is not a directory"),
    (["--plot", "afile/deeper/x.png"], "afile", "exists and is not a directory"),
    (["--json", "out/r.json", "--plot", "out/../out/r.json"], "r.json", "name the same file"),
    (["--json", "b.json", "--plot", "b.gif"], "b.gif", "matplotlib saves no '.gif' files"),
    (["--json", "new/b.json", "--plot", "new/b.PDFX"], "new/b.PDFX", "matplotlib saves no '.pdfx' files"),
])
def test_unusable_output_files_are_refused_before_the_gpu(argv, named, why, gpu_never_looked_for, capsys,
                                                          monkeypatch, tmp_path):
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("")
    line = _file_error(argv, capsys, monkeypatch, tmp_path)
    assert named in line and why in line


def test_a_plot_suffix_matplotlib_saves_passes_in_any_case(no_gpu, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(run, "_plot_formats", lambda: {"png", "pdf"})
    assert bench.main(["--plot", "sub/b.PNG", "--json", "sub/b.json"]) == 1  # the GPU is next
    assert no_gpu == [0] and not (tmp_path / "sub").exists()  # the folder is made when results are written


def test_plot_without_matplotlib_is_refused(gpu_never_looked_for, capsys, monkeypatch, tmp_path):
    line = _file_error(["--plot", "b.png"], capsys, monkeypatch, tmp_path, formats=None)
    assert "matplotlib" in line


def test_plot_without_matplotlib_names_the_path(gpu_never_looked_for, capsys, monkeypatch, tmp_path):
    line = _file_error(["--plot", "chart_here.png"], capsys, monkeypatch, tmp_path, formats=None)
    assert "chart_here.png" in line


def test_a_plot_without_a_suffix_cannot_overwrite_the_json(gpu_never_looked_for, capsys, monkeypatch, tmp_path):
    _file_error(["--json", "b.png", "--plot", "b"], capsys, monkeypatch, tmp_path)


@pytest.mark.parametrize("option", ["--json", "--plot"])
def test_unwritable_files_and_folders_are_refused(option, gpu_never_looked_for, capsys, monkeypatch, tmp_path):
    import gemmspec.output as output

    (tmp_path / "locked").mkdir()
    (tmp_path / "ro.png").write_text("")
    real_access = output.os.access
    denied = {str(tmp_path / "locked"), "locked", "ro.png", str(tmp_path / "ro.png")}
    # The tests may run as root, whom file modes do not stop: deny through os.access.
    monkeypatch.setattr(output.os, "access", lambda p, mode: str(p) not in denied and real_access(p, mode))
    line = _file_error([option, "locked/x.png"], capsys, monkeypatch, tmp_path)
    assert "locked" in line and "is not writable" in line
    line = _file_error([option, "ro.png"], capsys, monkeypatch, tmp_path)
    assert "ro.png" in line and "it is not writable" in line


# ------------------------------------------------------------------ without a Hopper GPU
@pytest.mark.parametrize("argv", [
    [], ["--repeat", "1"], ["--idle", "0"], ["--tile", "64x8"], ["--tile", "128x256"], ["--tile", "128X64"],
    ["--only", "fp8_dense_T4096_N7168_K7168"], ["--only", "decode", "ffn"], ["--no-deepgemm"],
    ["--sweep", "decode"], ["--json", "new/deeper/r.json"],
])
def test_good_options_reach_the_gpu_check_and_exit_1_without_one(argv, no_gpu, capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    assert cli_main(["bench", *argv]) == 1
    err = capsys.readouterr().err
    assert err == f"gemmspec bench: error: {NO_GPU}\n"
    assert no_gpu == [0] and list(tmp_path.iterdir()) == []


def test_a_gpu_other_than_hopper_is_exit_1(monkeypatch, capsys):
    message = ("CUDA device 0 (NVIDIA A100-SXM4-80GB) is sm_80; gemmspec's kernels are built for sm_90a and need "
               "a Hopper GPU (H100, H200, GH200)")

    def require_hopper(ordinal=0):
        raise DeviceUnavailableError(message)

    monkeypatch.setattr("gemmspec.runtime.arrays.require_hopper", require_hopper)
    assert bench.main(["--only", "decode"]) == 1
    assert capsys.readouterr().err == f"gemmspec bench: error: {message}\n"


# ------------------------------------------------------------------ a run on a stand-in device
class _Sampler:
    def __init__(self, gpu):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _fake_device(monkeypatch, name, measured, rows_by_case, cuda=True, sweep_rows=None):
    """A Hopper card called `name` whose copy runs at `measured` TB/s; each case's measure
    returns rows_by_case[name] (an exception is raised). Returns the calls made."""
    calls = {"measured": [], "deepgemm_load": 0}

    def measure(self, repeat):
        calls["measured"].append((self.name, repeat))
        rows = rows_by_case[self.name]
        if isinstance(rows, Exception):
            raise rows
        return list(rows)

    def load():
        calls["deepgemm_load"] += 1

    fake_cuda = types.SimpleNamespace(
        is_available=lambda: cuda, current_device=lambda: 0,
        get_device_properties=lambda d: types.SimpleNamespace(multi_processor_count=132),
        get_device_name=lambda: name, empty_cache=lambda: None,
    )
    fake_torch = types.SimpleNamespace(__version__="2.11.0+fake", cuda=fake_cuda, manual_seed=lambda s: None)
    monkeypatch.setattr("gemmspec.runtime.arrays.require_hopper", lambda ordinal=0: None)
    monkeypatch.setattr(run, "load_torch", lambda: fake_torch)
    monkeypatch.setitem(sys.modules, "triton", types.ModuleType("triton"))
    monkeypatch.setattr(run, "measure_copy_rate", lambda torch: measured)
    monkeypatch.setattr(run, "ClockSampler", _Sampler)
    monkeypatch.setattr(deepgemm, "load", load)
    monkeypatch.setattr(cases.Case, "measure", measure)
    if sweep_rows is not None:
        monkeypatch.setattr(run, "run_sweep", lambda s, repeat: sweep_rows(s))
    return calls


FP8_NAME = "fp8_fwd_G8x4096_N4096_K7168"
FP8_FLOPS = 2 * 8 * 4096 * 4096 * 7168
MASKED_NAME = "decode_masked_E32xM64_N4096_K7168"
MASKED_BYTES = 250e6


def _rows():
    fp8 = [bench.Result(FP8_NAME, "gemmspec", FP8_FLOPS / 1.25e12, FP8_FLOPS, "TFLOPS", "ok", sm_mhz=1500.0,
                        power_w=700.0, power_capped=1.0),
           bench.Result(FP8_NAME, "torch._scaled_grouped_mm", FP8_FLOPS / 1.0e12, FP8_FLOPS, "TFLOPS", "ok")]
    # 2.85 TB/s: 95 % of an H100's 3.0, 68 % of the H200's 4.2.
    masked = [bench.Result(MASKED_NAME, "gemmspec", MASKED_BYTES / 2.85e9, MASKED_BYTES, "TB/s", "ok"),
              bench.Result(MASKED_NAME, "torch._scaled_grouped_mm", MASKED_BYTES / 1.5e9, MASKED_BYTES, "TB/s")]
    return {FP8_NAME: fp8, MASKED_NAME: masked}


def test_a_run_on_another_card_writes_the_documented_json(monkeypatch, tmp_path, capsys):
    calls = _fake_device(monkeypatch, "NVIDIA H100 80GB HBM3", 3.0, _rows())
    out = tmp_path / "made" / "later" / "bench.json"
    argv = ["--only", FP8_NAME, "decode_masked_E32xM64_N4096", "--no-deepgemm", "--repeat", "3", "--json", str(out)]
    assert cli_main(["bench", *argv]) == 0
    assert calls["measured"] == [(FP8_NAME, 3), (MASKED_NAME, 3)] and calls["deepgemm_load"] == 0
    stdout = capsys.readouterr().out.splitlines()
    # The first line names the card, the rate used and this run's copy.
    assert stdout[0].startswith("GPU: NVIDIA H100 80GB HBM3 (132 SMs), torch 2.11.0+fake; copy rate: 3.00 TB/s")
    assert "this run's 1 GiB device-to-device copy" in stdout[0]
    assert not any("recorded 2026-11-30" in line for line in stdout)  # an H200's figure
    data = json.loads(out.read_text())
    assert (data["gpu"], data["torch"], data["deepgemm"]) == ("NVIDIA H100 80GB HBM3", "2.11.0+fake", None)
    assert data["copy_rate_tbs"] == 3.0 and data["measured_copy_rate_tbs"] == 3.0
    fp8, masked = data["cases"]
    assert fp8["case"] == FP8_NAME and fp8["verdict"] == "pass"  # 1250 >= 1230 TFLOPS, 1.25x torch >= 1.2x
    assert fp8["deepgemm_recorded_tflops"] is None
    assert fp8["peak_at_clock_tflops"] == pytest.approx(8192 * 132 * 1500e6 / 1e12)
    assert {"sm_mhz", "power_w", "power_capped", "rate"} <= set(fp8["rows"][0])
    assert (fp8["rows"][0]["sm_mhz"], fp8["rows"][0]["power_capped"]) == (1500.0, 1.0)
    assert "bytes_read" not in fp8 and "copy_share" not in fp8["rows"][0]
    assert masked["verdict"] == "pass, DeepGEMM's ratio not judged (it did not run)"
    assert masked["target"] == ">= 90% of 3.00 TB/s, >= 1.05x DeepGEMM"
    assert masked["bytes_read"] == MASKED_BYTES and masked["stream_floor_us"] is None
    assert masked["hbm_floor_us"] == pytest.approx(MASKED_BYTES / 3.0e12 * 1e6)
    assert [round(r["copy_share"], 4) for r in masked["rows"]] == [0.95, 0.5]


def test_a_run_on_an_h200_judges_against_4_2_and_shows_the_recorded_figures(monkeypatch, tmp_path, capsys):
    calls = _fake_device(monkeypatch, "NVIDIA H200", 4.31, _rows())
    out = tmp_path / "bench.json"
    assert bench.main(["--only", "fp8_fwd_G8x4096_N4096", "decode_masked_E32xM64_N4096", "--json", str(out)]) == 0
    assert calls["deepgemm_load"] == 1  # no --no-deepgemm: DeepGEMM is looked for (here: not found)
    stdout = capsys.readouterr().out
    first = stdout.splitlines()[0]
    assert "copy rate: 4.2 TB/s, the H200's recorded rate (this run's 1 GiB device-to-device copy: 4.31 TB/s)" in first
    assert "DeepGEMM 2.6.1 (recorded 2026-11-30)" in stdout
    data = json.loads(out.read_text())
    assert data["copy_rate_tbs"] == 4.2 and data["measured_copy_rate_tbs"] == 4.31
    fp8, masked = data["cases"]
    assert fp8["deepgemm_recorded_tflops"] == 1232.4
    assert masked["verdict"] == "MISS"  # 2.85 TB/s is 68 % of 4.2 TB/s, below 90 %
    assert masked["stream_floor_us"] == 235.3
    assert masked["hbm_floor_us"] == pytest.approx(MASKED_BYTES / 4.2e12 * 1e6)
    assert masked["rows"][0]["copy_share"] == pytest.approx(2.85 / 4.2)


def test_a_failed_case_is_reported_the_rest_still_run_and_the_exit_is_1(monkeypatch, capsys):
    g4 = "fp8_fwd_G4x8192_N6144_K7168"
    rows = _rows() | {"fp8_fwd_G8x4096_N7168_K2048": AssertionError("differs"),
                      g4: [bench.Result(g4, "gemmspec", 1.0, 1.3e12, "TFLOPS", "ok")]}
    calls = _fake_device(monkeypatch, "NVIDIA H100 80GB HBM3", 3.0, rows)
    assert bench.main(["--only", "fp8_fwd_G", "fp8_fwd_G8", "--no-deepgemm"]) == 1
    # Each case once, in the table's order, whatever the prefixes.
    assert [n for n, _ in calls["measured"]] == [FP8_NAME, "fp8_fwd_G8x4096_N7168_K2048", g4]
    out = capsys.readouterr().out
    assert f"{'fp8_fwd_G8x4096_N7168_K2048':36} FAILED: AssertionError: differs" in out
    assert f"{g4:36} {'gemmspec':44}" in out  # the case after the failure still ran


def test_tile_and_idle_reach_the_procedures(monkeypatch):
    _fake_device(monkeypatch, "NVIDIA H100 80GB HBM3", 3.0, _rows())
    assert bench.main(["--only", FP8_NAME, "--tile", "64X128", "--idle", "2.5", "--no-deepgemm"]) == 0
    assert specs.FORCED_TILE == (64, 128) and timing.IDLE_MS == 2.5


def test_torch_without_cuda_is_exit_1(monkeypatch, capsys):
    calls = _fake_device(monkeypatch, "NVIDIA H100 80GB HBM3", 3.0, _rows(), cuda=False)
    assert bench.main(["--only", FP8_NAME]) == 1
    assert "torch sees no CUDA device" in capsys.readouterr().err and calls["measured"] == []


def test_the_sweeps_json_has_every_point_and_both_rates(monkeypatch, tmp_path, capsys):
    def rows(s):
        out = []
        for p in sweep.points(s):
            out += [bench.Result(p.name, "gemmspec", p.bytes_read / 2.4e9, p.bytes_read, "TB/s", "ok"),
                    bench.Result(p.name, "torch._scaled_grouped_mm (rowwise scales)", p.bytes_read / 1.2e9,
                                 p.bytes_read, "TB/s", "")]
        return out, {}

    _fake_device(monkeypatch, "NVIDIA H100 80GB HBM3", 3.0, {}, sweep_rows=rows)
    out = tmp_path / "s" / "sweep.json"
    assert bench.main(["--sweep", "decode", "--json", str(out), "--no-deepgemm"]) == 0
    data = json.loads(out.read_text())
    assert data["copy_rate_tbs"] == 3.0 and data["measured_copy_rate_tbs"] == 3.0 and data["gpu"].endswith("HBM3")
    assert [p["tokens"] for p in data["points"]] == [2 ** i for i in range(13)]
    for p in data["points"]:
        assert {"tokens", "rows", "active_experts", "bytes_read", "hbm_floor_us", "systems"} <= set(p)
        assert p["rows"] == 8 * p["tokens"] and p["active_experts"] == min(256, p["active_experts"])
        assert p["hbm_floor_us"] == pytest.approx(p["bytes_read"] / 3.0e6)
        ours, torch_sys = p["systems"]
        assert ours["system"] == "gemmspec" and torch_sys["system"] == "torch._scaled_grouped_mm"
        assert ours["tbs"] == pytest.approx(2.4) and ours["copy_share"] == pytest.approx(0.8)
        assert ours["us"] == pytest.approx(p["bytes_read"] / 2.4e6)
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "sweep: " + sweep.SWEEPS["decode"].what + "; floor = bytes read / 3.00 TB/s"


# ------------------------------------------------------------------ verdicts, shares, cards
def _case(target, name="c"):
    return bench.Case(name, "", target, lambda r: [])


def _tf(ms, impl="gemmspec", work=2e12, case="c"):
    return bench.Result(case, impl, ms, work, "TFLOPS")


def test_each_target_is_met_at_its_bound():
    assert verdict(_case(bench.Target(tflops=1000)), _tf(2.0), None) == "pass"  # exactly 1000 TFLOPS
    assert verdict(_case(bench.Target(tflops=1000)), _tf(2.0 * 1.001), None) == "MISS"
    torch_row = _tf(2.4, "torch")
    assert verdict(_case(bench.Target(vs_torch=1.2)), _tf(2.0), torch_row) == "pass"  # 1.2x
    assert verdict(_case(bench.Target(vs_torch=1.2)), _tf(2.01), torch_row) == "MISS"
    assert verdict(_case(bench.Target(vs_torch=1.2)), _tf(1.0), None) == "MISS"  # no torch row to judge by
    assert verdict(_case(bench.Target(max_us=24)), _tf(0.024), None) == "pass"
    # Every target of a case must be met.
    both = _case(bench.Target(tflops=1000, max_us=1500))
    assert verdict(both, _tf(1.6), None) == "MISS" and verdict(both, _tf(1.5), None) == "pass"


def test_a_share_on_an_h200_is_of_4_2_whatever_its_copy_measured():
    case = BY_NAME["decode_dsv3_fp8_T64_N4096_K7168"]  # >= 85 % of the copy rate, >= 1.3x torch
    moved = 1e9
    ours = bench.Result(case.name, "gemmspec", moved / (0.86 * 4.2e9), moved, "TB/s")  # 3.61 TB/s
    torch_row = bench.Result(case.name, "torch", ours.ms * 2, moved, "TB/s")
    fast_h200 = Card("NVIDIA H200", 5.0)  # 3.61 TB/s is only 72 % of 5.0
    slow_h200 = Card("NVIDIA H200 NVL", 3.5)  # above 100 % of 3.5
    for card in (fast_h200, slow_h200):
        assert card.copy_rate_tbs == 4.2
        assert verdict(case, ours, torch_row, [torch_row], card) == "pass"
    slow = bench.Result(case.name, "gemmspec", moved / (0.84 * 4.2e9), moved, "TB/s")
    assert verdict(case, slow, torch_row, [torch_row], slow_h200) == "MISS"
    # On an H100 the same 3.61 TB/s is judged against its own copy: 4.0 TB/s makes it 90 %.
    assert verdict(case, ours, torch_row, [torch_row], Card("NVIDIA H100 PCIe", 4.0)) == "pass"
    assert verdict(case, ours, torch_row, [torch_row], Card("NVIDIA H100 PCIe", 4.3)) == "MISS"  # 84 %


def test_a_gh200_is_another_card():
    gh200 = Card("NVIDIA GH200 480GB", 3.9)
    assert gh200.copy_rate_tbs == 3.9 and not gh200.is_reference


def test_a_masked_decode_row_against_deepgemm_live_and_not(capsys):
    ours = bench.Result(MASKED_NAME, "gemmspec", MASKED_BYTES / 2.85e9, MASKED_BYTES, "TB/s", "ok")
    dg = [bench.Result(MASKED_NAME, "DeepGEMM 2.5.0 (masked)", ours.ms * r, MASKED_BYTES, "TB/s", "ok")
          for r in (1.04, 1.06)]
    _, s = bench.report([ours, dg[0]], {}, 132, H100)
    assert s[0]["verdict"] == "MISS"  # 1.04x, the target is 1.05x
    text, s = bench.report([ours, dg[1]], {}, 132, H100)
    assert s[0]["verdict"] == "pass" and "target >= 90% of 3.00 TB/s, >= 1.05x DeepGEMM: pass;" in text
    text, s = bench.report([ours], {}, 132, H100)
    assert "DeepGEMM: pass, DeepGEMM's ratio not judged (it did not run);" in text


def test_the_bf16_peak_is_4096_flops_per_sm_and_cycle():
    name = "bf16_fwd_G8x4096_N4096_K7168"
    ours = bench.Result(name, "gemmspec", 1.0, 6e11, "TFLOPS", "ok", sm_mhz=1600.0, power_w=690.0, power_capped=0.0)
    text, summary = bench.report([ours], {}, 132, H200)
    roof = 4096 * 132 * 1600e6 / 1e12
    assert summary[0]["peak_at_clock_tflops"] == pytest.approx(roof)
    assert f"the BF16 peak at 1600 MHz is {roof:.0f} TFLOPS: {600 / roof:.0%} of it" in text
    assert " 1600 MHz  690 W " in text  # not at the cap: no star
    # Recorded DeepGEMM figure (H200) with gemmspec's ratio to it: 600 / 697.6.
    assert f"697.6 TFLOPS {600 / 697.6:10.2f}x (gemmspec / it)" in text


@pytest.mark.parametrize("capped, star", [(0.0, False), (0.4, False), (0.5, True), (0.6, True), (1.0, True)])
def test_the_power_cap_star_marks_rows_capped_in_at_least_half_the_samples(capped, star):
    ours = _tf(2.0, case=FP8_NAME)
    ours.sm_mhz, ours.power_w, ours.power_capped = 1450.0, 700.0, capped
    text, _ = bench.report([ours], {}, 132, H200)
    assert (" 1450 MHz  700 W*" in text) is star


def test_faster_than_separate_launches_is_strict():
    case = BY_NAME["lora_expand_L4xE8_R16_N4096_T8192"]
    ours = bench.Result(case.name, "gemmspec fused", 0.05, 1e8, "TB/s")
    same = bench.Result(case.name, "gemmspec BF16 GEMM + torch element-wise", 0.05, 1e8, "TB/s")
    assert verdict(case, ours, None, [same]) == "MISS"


def test_every_compute_bound_case_gives_the_peak_at_its_clock():
    name = "ffn_fp8_E8_T32768_H7168_F2048"
    ours = bench.Result(name, "gemmspec fused (FP8 h from the epilogue)", 1.0, 1e12, "TFLOPS", sm_mhz=1500.0,
                        power_w=700.0, power_capped=1.0)
    _, summary = bench.report([ours], {}, 132, H200)
    assert summary[0]["peak_at_clock_tflops"] is not None


def test_a_row_with_a_clock_and_no_power_is_reported():
    ours = bench.Result(FP8_NAME, "gemmspec", 1.6, 2e12, "TFLOPS", sm_mhz=1500.0)
    text, _ = bench.report([ours], {}, 132, H200)
    assert " 1500 MHz" in text


def test_the_sweeps_floor_on_an_h200_is_at_4_2():
    s = sweep.Sweep("small", experts=16, top_k=2, n=256, k=256, tokens=(2, 8))
    pts = sweep.points(s)
    results = [bench.Result(p.name, "gemmspec", p.bytes_read / 3.0e9, p.bytes_read, "TB/s", "ok") for p in pts]
    text, summary = sweep.sweep_report(s, results, {}, H200)
    assert text.splitlines()[0] == "sweep: small; floor = bytes read / 4.2 TB/s"
    assert summary["copy_rate_tbs"] == 4.2
    for p, entry in zip(pts, summary["points"]):
        assert entry["hbm_floor_us"] == pytest.approx(p.bytes_read / 4.2e6)
        assert entry["systems"][0]["copy_share"] == pytest.approx(3.0 / 4.2)
        assert entry["rows"] == 2 * p.tokens


# ------------------------------------------------------------------ the case table
def _ints(pattern, name):
    m = re.fullmatch(pattern, name)
    assert m, name
    return [int(g) for g in m.groups()]


def test_every_cases_name_states_its_shape():
    for c in bench.CASES:
        s, n = c.shape, c.name
        if n.startswith(("fp8_fwd_G", "bf16_fwd_G", "fp8_wgrad_G", "fp8_rowwise_G")):
            g, t, nn, k = _ints(r"[a-z0-9_]+_G(\d+)x(\d+)_N(\d+)_K(\d+)", n)
            assert s == {"lengths": [t] * g, "n": nn, "k": k}, n
        elif "_ragged_T" in n:
            t, nn, k = _ints(r"fp8_(?:fwd|wgrad)_ragged_T(\d+)_N(\d+)_K(\d+)", n)
            assert sum(s["lengths"]) == t and (s["n"], s["k"]) == (nn, k)
        elif n.startswith("fp8_gather_G"):
            g, t, nn, k = _ints(r"fp8_gather_G(\d+)x(\d+)_N(\d+)_K(\d+)", n)
            assert s["e"] == g and s["tokens"] * 2 == g * t and (s["n"], s["k"]) == (nn, k)  # top-2
        elif n.startswith("fp8_masked_G"):
            g, m, nn, k = _ints(r"fp8_masked_G(\d+)_M(\d+)_N(\d+)_K(\d+)", n)
            assert len(s["counts"]) == g and s["m"] == m and (s["n"], s["k"]) == (nn, k)
            assert all(0 <= x <= m for x in s["counts"])
        elif n.startswith("fp8_dense"):
            assert s == dict(zip(("t", "n", "k"), _ints(r"fp8_dense_T(\d+)_N(\d+)_K(\d+)", n)))
        elif n.startswith("lora_shrink"):
            lo, e, r, k, t = _ints(r"lora_shrink_L(\d+)xE(\d+)_R(\d+)_K(\d+)_T(\d+)", n)
            assert s == {"loras": lo, "experts": e, "r": r, "k": k, "t": t}
        elif n.startswith("lora_expand"):
            lo, e, r, nn, t = _ints(r"lora_expand_L(\d+)xE(\d+)_R(\d+)_N(\d+)_T(\d+)", n)
            counts = s["counts"]
            assert len(counts) == lo and all(len(row) == e for row in counts)
            assert sum(map(sum, counts)) == t and (s["r"], s["n"]) == (r, nn)
        elif n.startswith("ffn_fp8"):
            e, t, h, f = _ints(r"ffn_fp8_E(\d+)_T(\d+)_H(\d+)_F(\d+)", n)
            assert s["e"] == e and s["tokens"] * s["top_k"] == t and (s["hidden"], s["f"]) == (h, f)
        elif n.startswith("ffn_decode"):
            model, t = re.fullmatch(r"ffn_decode_(dsv3|qwen3)_T(\d+)", n).groups()
            experts, hidden, f = (256, 7168, 2048) if model == "dsv3" else (128, 2048, 768)
            assert (s["tokens"], s["experts"], s["hidden"], s["f"], s["top_k"]) == (int(t), experts, hidden, f, 8)
        elif n.startswith("decode_ragged"):
            e, t, nn, k = _ints(r"decode_ragged_E(\d+)_T(\d+)_N(\d+)_K(\d+)", n)
            assert len(s["lengths"]) == e and sum(s["lengths"]) == t and (s["n"], s["k"]) == (nn, k)
        elif n.startswith("decode_masked"):
            e, m, nn, k = _ints(r"decode_masked_E(\d+)xM(\d+)_N(\d+)_K(\d+)", n)
            assert (len(s["counts"]), s["m"], s["n"], s["k"]) == (e, m, nn, k) and max(s["counts"]) <= m
        elif n.startswith(("decode_dsv3", "decode_qwen3")):
            t, nn, k = _ints(r"decode_(?:dsv3_fp8|qwen3_fp8|qwen3_bf16)_T(\d+)_N(\d+)_K(\d+)", n)
            experts = 256 if "dsv3" in n else 128
            assert len(s["lengths"]) == experts and sum(s["lengths"]) == 8 * t and (s["n"], s["k"]) == (nn, k)
        else:
            pytest.fail(f"a case of no documented family: {n}")


def test_the_documented_rows_and_their_targets():
    fwd = [n for n in BY_NAME if n.startswith("fp8_fwd")]
    # "FP8 1x128/128x128 M-grouped (three shapes and a ragged unpadded one)"
    assert len(fwd) == 4 and sum(n.startswith("fp8_fwd_G") for n in fwd) == 3
    ragged = BY_NAME["fp8_fwd_ragged_T32768_N4096_K7168"].shape["lengths"]
    assert any(x % 128 for x in ragged) and 0 in ragged  # unpadded: not 128-row multiples, an empty group
    expand = BY_NAME["lora_expand_L4xE8_R16_N4096_T8192"]
    assert expand.target == bench.Target(vs_separate=1.0) and expand.memory_bound  # faster than every path
    ffn = BY_NAME["ffn_fp8_E8_T32768_H7168_F2048"]
    assert ffn.target == bench.Target(vs_torch=1.0)  # "no slower than the torch one"
    assert BY_NAME["lora_shrink_L4xE8_R16_K4096_T8192"].memory_bound
    # "the ragged WGRAD row has no DeepGEMM anchor"
    wgrad_ragged = BY_NAME["fp8_wgrad_ragged_T32768_N4096_K7168"]
    assert not any(a.__module__.endswith("anchors.deepgemm") for a in wgrad_ragged.anchors)
    assert "segment_major pad 16" in wgrad_ragged.what
    # DeepGEMM's M-grouped contiguous, masked, dense and K-grouped WGRAD kernels.
    assert deepgemm.m_grouped_fp8 in BY_NAME[FP8_NAME].anchors
    assert deepgemm.m_grouped_fp8_masked in BY_NAME["fp8_masked_G6_M1024_N4096_K7168"].anchors
    assert deepgemm.dense_fp8 in BY_NAME["fp8_dense_T4096_N7168_K7168"].anchors
    assert deepgemm.k_grouped_fp8_wgrad in BY_NAME["fp8_wgrad_G8x4096_N4096_K7168"].anchors


def test_recorded_deepgemm_figures_belong_to_rows_deepgemm_can_run():
    recorded = {n: c for n, c in BY_NAME.items() if c.deepgemm_recorded_tflops is not None}
    assert set(recorded) == {"fp8_fwd_G8x4096_N4096_K7168", "fp8_fwd_G8x4096_N7168_K2048",
                             "fp8_fwd_G4x8192_N6144_K7168", "fp8_fwd_ragged_T32768_N4096_K7168",
                             "bf16_fwd_G8x4096_N4096_K7168", "fp8_wgrad_G8x4096_N4096_K7168",
                             "fp8_masked_G6_M1024_N4096_K7168", "fp8_dense_T4096_N7168_K7168"}
    for c in recorded.values():
        assert any(a.__module__.endswith("anchors.deepgemm") for a in c.anchors), c.name


def test_usage_lists_every_row_of_the_table():
    documented = {
        "fp8_fwd_G8x4096_N4096_K7168", "fp8_fwd_G8x4096_N7168_K2048", "fp8_fwd_G4x8192_N6144_K7168",
        "fp8_fwd_ragged_T32768_N4096_K7168", "bf16_fwd_G8x4096_N4096_K7168", "fp8_wgrad_G8x4096_N4096_K7168",
        "fp8_wgrad_ragged_T32768_N4096_K7168", "fp8_masked_G6_M1024_N4096_K7168", "fp8_dense_T4096_N7168_K7168",
        "lora_shrink_L4xE8_R16_K4096_T8192", "ffn_fp8_E8_T32768_H7168_F2048", "lora_expand_L4xE8_R16_N4096_T8192",
        "fp8_rowwise_G8x4096_N4096_K7168", "fp8_gather_G8x4096_N4096_K7168",
        "ffn_decode_dsv3_T64", "ffn_decode_dsv3_T512", "ffn_decode_qwen3_T128",
    }
    assert {n for n in BY_NAME if not n.startswith("decode_")} == documented


def test_the_decode_rows_are_the_documented_models_and_token_counts():
    decode = [n for n in BY_NAME if n.startswith("decode_")]
    ragged = sorted(len(BY_NAME[n].shape["lengths"]) for n in decode if n.startswith("decode_ragged"))
    assert set(ragged) == {8, 32}  # "ragged counts of 32 and 8 experts"
    dsv3 = {tuple(_ints(r"decode_dsv3_fp8_T(\d+)_N(\d+)_K(\d+)", n)) for n in decode if "dsv3" in n}
    assert dsv3 == {(t, n, k) for t in (64, 512) for n, k in ((4096, 7168), (7168, 2048))}
    for kind in ("bf16", "fp8"):
        qwen = {tuple(_ints(rf"decode_qwen3_{kind}_T(\d+)_N(\d+)_K(\d+)", n)) for n in decode if f"qwen3_{kind}" in n}
        assert qwen == {(t, n, k) for t in (16, 128, 512) for n, k in ((1536, 2048), (2048, 768))}
    assert {n for n in decode if n.startswith("decode_masked")} == {
        "decode_masked_E32xM64_N4096_K7168", "decode_masked_E32xM64_N7168_K2048"}
    # Seeded: the same counts on every run (a fresh import draws the same routing).
    code = ("from gemmspec.bench import CASES; import json; "
            "print(json.dumps({c.name: c.shape.get('lengths') for c in CASES if c.name.startswith('decode_')}))")
    again = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(again.stdout) == {n: BY_NAME[n].shape.get("lengths") for n in decode}


def test_the_sweep_is_usages_shape():
    s = sweep.SWEEPS["decode"]
    assert list(sweep.SWEEPS) == ["decode"]
    assert "DeepSeek-V3 gate/up" in s.what and "256 experts top-8, N=4096, K=7168" in s.what
    assert s.tokens[0] == 1 and s.tokens[-1] == 4096 and all(b == 2 * a for a, b in zip(s.tokens, s.tokens[1:]))


def test_list_with_only_lists_the_cases_it_picks(gpu_never_looked_for, capsys):
    assert bench.main(["--list", "--only", "decode_masked", "lora_shrink"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert listed == ["lora_shrink_L4xE8_R16_K4096_T8192", "decode_masked_E32xM64_N4096_K7168",
                      "decode_masked_E32xM64_N7168_K2048"]  # table order


def test_a_call_does_not_inherit_an_earlier_calls_tile_or_idle(gpu_never_looked_for, capsys):
    assert bench.main(["--tile", "64x64", "--idle", "2", "--list"]) == 0
    assert (specs.FORCED_TILE, timing.IDLE_MS) == ((64, 64), 2.0)
    assert bench.main(["--list"]) == 0
    assert (specs.FORCED_TILE, timing.IDLE_MS) == (None, 0.0)
    capsys.readouterr()
