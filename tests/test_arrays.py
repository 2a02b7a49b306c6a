"""partialfl.arrays: the one numpy/torch switch behaves the same on both kinds."""

import ast
from pathlib import Path

import numpy as np
import pytest
import torch

from partialfl import arrays
from partialfl.tree import flatten_stacked


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_helpers_agree_on_numpy_and_torch(kind):
    base = np.arange(12, dtype=np.float64).reshape(3, 4)
    x = torch.from_numpy(base.copy()) if kind == "torch" else base.copy()
    assert arrays.is_torch(x) == (kind == "torch") and arrays.is_array(x)
    assert not arrays.is_array([1.0]) and not arrays.is_torch(base)
    np.testing.assert_array_equal(arrays.to_numpy(x), base)
    c = arrays.copy(x)
    c[0, 0] = -1.0
    assert float(x[0, 0]) == 0.0  # an independent copy
    np.testing.assert_array_equal(arrays.to_numpy(arrays.concat([x, x], 1)),
                                  np.concatenate([base, base], 1))
    np.testing.assert_array_equal(arrays.to_numpy(arrays.take_rows(x, [2, 0])), base[[2, 0]])
    np.testing.assert_array_equal(arrays.to_numpy(arrays.take_rows(x, np.array([1, 0, 1],
                                                                              dtype=bool))),
                                  base[[0, 2]])
    scaled = x * arrays.per_row(np.array([1.0, 2.0, 3.0]), x)
    np.testing.assert_array_equal(arrays.to_numpy(scaled), base * np.array([[1.0], [2.0], [3.0]]))
    assert arrays.is_torch(scaled) == (kind == "torch")
    rep = arrays.repeat_rows(x[0], 2)
    rep[0, 0] = 5.0
    assert tuple(rep.shape) == (2, 4) and float(rep[1, 0]) == 0.0 and float(x[0, 0]) == 0.0
    y = x.clone() if kind == "torch" else x.copy()
    y[1, 2] = np.nan
    np.testing.assert_array_equal(arrays.rows_finite(y), [True, False, True])
    back = arrays.as_like([1, 2], x)
    assert arrays.is_torch(back) == (kind == "torch") and back.dtype == x.dtype


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_flatten_stacked_round_trips_vectors_and_matrices(kind):
    rng = np.random.default_rng(0)
    tree = {"a": rng.normal(size=(3, 2, 2)), "b": rng.normal(size=(3,))}
    if kind == "torch":
        tree = {n: torch.from_numpy(v) for n, v in tree.items()}
    mat, unflatten = flatten_stacked(tree)
    assert tuple(mat.shape) == (3, 5)
    back = unflatten(mat)
    row = unflatten(mat[1])
    for n in tree:
        np.testing.assert_array_equal(arrays.to_numpy(back[n]), arrays.to_numpy(tree[n]))
        np.testing.assert_array_equal(arrays.to_numpy(row[n]), arrays.to_numpy(tree[n][1]))


def test_to_torch_copies_into_a_contiguous_cpu_tensor():
    a = np.arange(6.0).reshape(2, 3).T  # not contiguous
    t = arrays.to_torch(a)
    assert arrays.is_torch(t) and t.is_contiguous() and t.dtype == torch.float64
    t[0, 0] = 9.0
    assert a[0, 0] == 0.0
    u = arrays.to_torch(t)
    u[0, 0] = 1.0
    assert float(t[0, 0]) == 9.0


def test_where_rows_and_zeros_like_keep_the_kind():
    for x in (np.ones((3, 2)), torch.ones(3, 2)):
        z = arrays.zeros_like(x)
        out = arrays.where_rows(np.array([True, False, True]), x, z)
        assert arrays.is_torch(out) == arrays.is_torch(x)
        np.testing.assert_array_equal(arrays.to_numpy(out), [[1, 1], [0, 0], [1, 1]])


SRC = Path(__file__).resolve().parents[1] / "src" / "partialfl"


def test_only_the_arrays_module_tells_numpy_from_torch_by_attribute():
    offenders = []
    for p in SRC.rglob("*.py"):
        if p.name == "arrays.py":
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "hasattr"
                    and len(node.args) == 2 and isinstance(node.args[1], ast.Constant)
                    and node.args[1].value in ("detach", "clone", "numpy", "cpu")):
                offenders.append(f"{p.relative_to(SRC)}:{node.lineno}")
    assert not offenders, offenders


def test_algorithms_and_local_trainers_use_no_parameter_key_literal():
    """Algorithms speak the problem's names (theta_names, w_names, ...), never "theta"/"w"
    as a tree key."""
    offenders = []
    files = [*(SRC / "algorithms").glob("*.py"), *(SRC / "local").glob("*.py")]
    for p in files:
        for node in ast.walk(ast.parse(p.read_text())):
            keys = []
            if isinstance(node, ast.Subscript):
                keys = [node.slice]
            elif isinstance(node, ast.Dict):
                keys = [k for k in node.keys if k is not None]
            for k in keys:
                if isinstance(k, ast.Constant) and k.value in ("theta", "w"):
                    offenders.append(f"{p.relative_to(SRC)}:{node.lineno}")
    assert not offenders, offenders


@pytest.mark.parametrize("kind", ["numpy", "torch"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "float64"])
def test_rows_finite_is_exact_where_a_row_sum_overflows(kind, dtype):
    """The one-pass check (a row's sum) falls back to the elementwise check on the rows whose
    sum is not finite: a finite row that overflows its sum stays finite; NaN, ±inf and
    inf - inf rows are caught; rows of length 0 and integer arrays are finite."""
    big = float(np.finfo(dtype).max) / 2
    rows = [[1.0, 2.0, 3.0], [big, big, big], [-big, -big, 1.0], [np.nan, 0.0, 0.0],
            [np.inf, -np.inf, 0.0], [0.0, -np.inf, 1.0], [big, big, np.nan]]
    a = np.array(rows, dtype=dtype)
    x = a if kind == "numpy" else __import__("torch").from_numpy(a)
    assert arrays.rows_finite(x).tolist() == [True, True, True, False, False, False, False]
    assert arrays.rows_finite(x[:, :0]).tolist() == [True] * 7
    ints = np.arange(6).reshape(3, 2)
    ints = ints if kind == "numpy" else __import__("torch").from_numpy(ints)
    assert arrays.rows_finite(ints).tolist() == [True] * 3


def test_finite_rows_of_a_tensor_never_copies_it_to_the_host(monkeypatch):
    """The server's finite-row check of a cohort's stacked updates runs where the tensor lives:
    on an accelerator a host copy of [k, d] cost 2 s per round at k = 100 (LEAF CNN, H200)."""
    import torch

    from partialfl.aggregation import common
    from partialfl.aggregation.basic import Mean, aggregate_tree

    def refuse(x):
        if arrays.is_torch(x) and x.numel() > 4:
            raise AssertionError("a [k, d] tensor was copied to numpy")
        return np.asarray(x.detach()) if arrays.is_torch(x) else np.asarray(x)

    monkeypatch.setattr(arrays, "to_numpy", refuse)
    x = torch.arange(12.0).reshape(3, 4)
    x[1, 2] = float("nan")
    assert common.finite_rows(x).tolist() == [True, False, True]
    with pytest.warns(RuntimeWarning, match="skipped 1 of 3"):
        out = aggregate_tree(Mean(weighted=True), {"a": x}, torch.ones(3))
    assert torch.equal(out["a"], (x[0] + x[2]) / 2)
