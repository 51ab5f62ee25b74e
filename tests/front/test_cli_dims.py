"""`--dims` of `gemmspec run` and `tune`: a size the kernels cannot index, a negative or
non-integer one, an unknown name or a dim the spec fixes is a usage error (exit 2, one
line, no traceback), found before any device is looked for."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from gemmspec.cli import main
from gemmspec.errors import ArgumentError
from gemmspec.pipeline import lower_file
from gemmspec.reference.data import check_run_dims, random_runtime

SPEC = """\
gemm dims_probe {
  dim T
  dim N = 64, K = 128
  group expert[E = 2] = ragged(T, offsets = expert_offsets)
  tensor x : bf16 [T, K]
  tensor w : bf16 [E, N, K]
  tensor y : bf16 [T, N]
  y[t, n] = sum[k] x[t, k] * w[expert(t), n, k]
}
"""


@pytest.fixture
def spec_file(tmp_path: Path) -> Path:
    path = tmp_path / "probe.gspec"
    path.write_text(SPEC)
    return path


@pytest.mark.parametrize("command", ["run", "tune"])
@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("T=2147483648", "dim 'T' is 2147483648: expected 0 to 2147483647"),
        ("T=9223372036854775808", "dim 'T' is 9223372036854775808: expected 0 to 2147483647"),
        ("T=-1", "dim 'T' is -1: expected 0 to 2147483647"),
        ("T=1.5", "--dims T: expected an integer size, got '1.5'"),
        ("T=\u00b2", "--dims T: expected an integer size"),
        ("T=", "--dims T: expected an integer size, got ''"),
        ("Q=4", "spec 'dims_probe' has no dim 'Q' (its run-time dims: T)"),
        ("N=64", "dim 'N' of spec 'dims_probe' is fixed at 64 by the spec"),
        ("=4", "--dims expects NAME=SIZE, got '=4'"),
    ],
)
def test_bad_dims_are_usage_errors(command, item, message, spec_file, no_device, capsys) -> None:
    assert main([command, str(spec_file), "--dims", item]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gemmspec: error: --dims") and message in err, err
    assert "Traceback" not in err and err.count("\n") == 1


def test_a_dim_given_twice(spec_file, no_device, capsys) -> None:
    assert main(["run", str(spec_file), "--dims", "T=4", "T=8"]) == 2
    assert "--dims gives 'T' twice" in capsys.readouterr().err


def test_the_library_refuses_the_same_sizes() -> None:
    (lowered,) = lower_file(SPEC)
    spec = lowered.spec
    check_run_dims(spec, {"T": 0})
    check_run_dims(spec, {"T": 2**31 - 1})
    for dims in ({"T": 2**31}, {"T": -3}, {"T": 2.0}, {"T": True}, {"Q": 1}, {"K": 128}):
        with pytest.raises(ArgumentError):
            check_run_dims(spec, dims)
    with pytest.raises(ArgumentError, match="2147483648"):
        random_runtime(spec, np.random.default_rng(0), dims={"T": 2**31})
    # Lengths that overflow int32 when summed are refused as such, not wrapped around.
    with pytest.raises(ArgumentError, match="add up to 4294967294, more than 2147483647"):
        random_runtime(spec, np.random.default_rng(0), lengths={"expert": [2**31 - 1, 2**31 - 1]})
