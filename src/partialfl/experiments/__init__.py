"""Experiments: configs → runs → JSONL metrics, PNG plots and markdown tables; the
reproductions are registered entries of kind ``reproduction`` (:mod:`partialfl.reproductions`).
"""
