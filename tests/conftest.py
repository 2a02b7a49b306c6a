"""Shared fixtures. Real-data tests use the ``data_dir`` fixture, which skips with a reason
when ../shared/data is absent."""

from __future__ import annotations

import numpy as np
import pytest
from _flower_loopback import loopback  # noqa: F401 - a federation in one process, no Ray
from _flower_sims import flower_runs  # noqa: F401 - one simulated federation, shared
from _user_project import user_module  # noqa: F401 - a user's own model module

from partialfl.data.paths import default_data_dir
from partialfl.problems.least_squares import LeastSquaresProblem, LeastSquaresSpec, generate_raw

SMALL = LeastSquaresSpec(num_clients=6, n=60, d_theta=8, d_w=4, seed=1)


@pytest.fixture(scope="session")
def small_spec() -> LeastSquaresSpec:
    return SMALL


@pytest.fixture(scope="session", params=["eigen", "standard"])
def small_ls(request) -> LeastSquaresProblem:
    return LeastSquaresProblem(SMALL, basis=request.param)


@pytest.fixture(scope="session")
def small_raw():
    return list(generate_raw(SMALL))


@pytest.fixture(scope="session")
def paper_ls() -> LeastSquaresProblem:
    """The paper's Example 1 at full size (32 clients, n = 10000), seed 0."""
    return LeastSquaresProblem()


@pytest.fixture(scope="session")
def data_dir():
    d = default_data_dir()
    if d is None or not d.is_dir():
        pytest.skip("real data folder ../shared/data not found (set PARTIALFL_DATA_DIR)")
    return d


def rel(a, b) -> float:
    a, b = np.asarray(a), np.asarray(b)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))
