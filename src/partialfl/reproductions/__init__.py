"""Reproductions (``partialfl reproduce NAME``): the paper's figures and our tables, each a
registered entry of kind ``reproduction`` whose build is ``reproduce(out_dir, *, quick,
seeds, data_dir, progress, …) -> summary path``. Importing this package registers them."""

from partialfl.experiments import (  # noqa: F401 - registers the reproductions
    asynchronous,
    byzantine,
    faults,
    femnist,
    har,
    least_squares,
    shakespeare,
)
