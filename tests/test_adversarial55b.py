"""Adversarial round 55b (issue 21, areas 1, 3, 4, 7 and 8, tried again from scratch by
someone who did not write the fixes, against d8b3d3a: round 54b's checks where a
researcher's own model and data enter). Each test failed on that code because of the defect
it names, and passes since the fix: a text task's token inputs are checked against the
labels' vocabulary at build and by ``evaluate --data`` (``build.run.check_tokens``); a pool
whose run torch refuses to pickle (``RuntimeError``) or whose workers fail to start
(``WorkerStartError``) stops the run in one line (``RunSetupError``).

* Area 8 (files), a text client whose integer inputs hold a token id beyond the
  vocabulary is a traceback. The registered ``transformer`` takes its vocabulary from the
  data's labels (``vocab_size = num_classes``, :func:`partialfl.models.transformer._transformer`);
  :class:`partialfl.data.federated.FederatedDataset` checks the labels' range, never the
  token inputs' — and :func:`partialfl.build.run._check_forward` passes only the first
  example. A folder of per-client ``.npz`` next-token files (``x``, ``y`` int64 ``[n, 8]``,
  tokens 0–9) in which one client's ``x`` holds a token 12 once (a BOS / padding id that is
  never a label: a researcher's export) passes ``--dry-run`` (exit 0), and ``partialfl
  train`` then counts that client's computations as failures ("skipping client 3 in round 1:
  it failed (IndexError: index out of range in self)") and ends in ``IndexError: index out
  of range in self`` with a full traceback, exit 1, from the evaluation's ``nn.Embedding``.
  The same file among the new clients of ``partialfl evaluate RUN --data DIR`` (round 54b's
  ``_check_fits`` compares shapes, dtypes and the labels' maximum, not the token inputs)
  ends the same way. Expected: one line naming the client / token, exit 2, as for a label
  beyond the classes. Suspected root cause: no check of integer (token) inputs against the
  model's vocabulary in ``FederatedDataset`` / ``build.run`` (training) and
  :func:`partialfl.pipeline.train._check_fits` (``evaluate --data``).

* Area 1, round 54b's ``RunSetupError`` is partial: :class:`partialfl.runtime.pool.WorkerPool`
  turns a run that cannot be pickled for ``spawn`` / ``forkserver`` workers into one line
  only for ``PicklingError``, ``AttributeError`` and ``TypeError``. torch's own tensor
  reducer (``torch.multiprocessing.reductions.reduce_tensor``, registered on the
  ``ForkingPickler``) raises ``RuntimeError: Cowardly refusing to serialize non-leaf tensor
  which requires_grad ...`` for a module attribute that is a computed tensor
  (``self.scale = self.a.bias.sum() * 0 + 1.0`` in ``__init__``: a cached non-leaf). With
  ``backend.name = "processes"``, ``start_method = "spawn"`` (or ``forkserver``) every
  client is skipped as failed ("skipping client 0 in round 0: it failed (RuntimeError:
  Cowardly refusing ...)") and the run ends in that RuntimeError with a full traceback, exit
  1 — the very pattern 54b fixed for a lambda attribute. The same model trains with
  ``fork`` and sequentially (exit 0). Suspected root cause: the ``except`` tuple around
  ``self._spawn(w)`` in ``WorkerPool.__init__`` (any exception of pickling the run, not three
  types).
* Area 1, a worker pool none of whose workers can start ends in a traceback, exit 1, after
  every client of the cohort is counted as failed: a run that pickles for ``spawn`` but
  cannot be *unpickled* in the worker (here a user model whose ``__setstate__`` raises, as
  a module attribute that reopens a resource on unpickling does when that fails) makes
  each worker die at start ("skipping client 0 in round 0: it failed (WorkerError: worker
  process partialfl-worker-1 failed to start: died (exit code 1))"), then
  :meth:`partialfl.runtime.faults.FaultLog.raise_if_systematic` re-raises the first error,
  a :class:`partialfl.runtime.pool.WorkerError` — a ``RuntimeError`` the CLI prints as a
  full traceback (its ``RuntimeError`` branch is for Flower runs only). A set-up failure of
  the pool (``wait_ready``: "a start failure is a bug, not a fault") is neither a client's
  failure nor worth a traceback: one line, as for every worker dying later and for round
  54b's ``RunSetupError``. Suspected root cause: ``WorkerPool.wait_ready``'s start failure
  raised through the client path (``run_clients`` → ``FaultLog.client_error``) as a
  ``WorkerError`` instead of a ``RunSetupError``.

Tried and held (run unless marked "read"): user models named by a config (``--allow-code``)
— ``BatchNorm1d`` MLP and ``BatchNorm2d`` CNN under ``backend.name = "vmap"`` (train and
``evaluate``), the CNN with splits ``input``, ``norm``, ``adapter`` (train, ``evaluate``:
``deployed_split``'s ``w_pretrained`` with running statistics accepted), ``full`` (refused
in one line), ``InstanceNorm2d(track_running_stats=True)``, ``nn.Dropout`` and functional
``F.dropout(..., self.training)`` under vmap (run), a ``BatchNorm2d(momentum=None)`` under
vmap (one line, exit 2), a ``.double()`` model on uint8 and on float64 client files (one
line: the data is float32); the registered ``transformer`` on a folder of int64 token files
(trains, ``evaluate`` works; ``evaluate --data`` with sequences of another length: one line);
a ``spawn`` worker SIGKILLed 0.05 s, 0.3 s and 1 s into its start (the run
finishes, exit 0); held-out clients of which some have no test example (runs; their accuracies
NaN in
``new_clients.json``); ``advise CONFIG --threads`` 0 / −1 / 10¹¹ (one line, exit 2, no
``--out`` written), ``abc`` / ``1.5`` (argparse, exit 2); (read) ``tree.fitted`` casts and
checks shape and finiteness per leaf, ``PersonalizedModels.load`` / ``advisor.fit_theta``
call it.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
from _adv_cli import env
from _user_project import client_folder, tiny_toml

TEXT_MODEL = "{ num_layers = 1, num_heads = 2, d_model = 16, d_ff = 32 }"


def _text_folder(d, clients: int, bad: int | None = None, seed: int = 0):
    """Next-token client files (int64 ``x``, ``y`` of shape [n, 8], tokens 0–9); client
    ``bad`` has one input token 12 (never a label)."""
    rng = np.random.default_rng(seed)
    d.mkdir(parents=True, exist_ok=True)
    for m in range(clients):
        s = rng.integers(0, 10, (10 + m, 9))
        x, y = s[:, :-1].copy(), s[:, 1:].copy()
        if m == bad:
            x[1, 0] = 12
        np.savez(d / f"c{m}.npz", x=x.astype(np.int64), y=y.astype(np.int64))
    return d


def _cli(tmp_path, *args, timeout: float = 170):
    return subprocess.run([sys.executable, "-m", "partialfl", *args, "--no-progress"],
                          cwd=tmp_path, env=env(None), capture_output=True, text=True,
                          timeout=timeout)


def _text_train(tmp_path, data, name: str):
    cfg = tiny_toml(tmp_path / f"{name}.toml", "transformer", data, name="text",
                    options=TEXT_MODEL)
    return _cli(tmp_path, "train", str(cfg), "--out", str(tmp_path / "runs" / name)), \
        tmp_path / "runs" / name


def _one_line(p, rc: int = 2) -> None:
    assert p.returncode == rc and "Traceback" not in p.stderr, \
        f"exit {p.returncode}: {p.stderr.strip().splitlines()[-1:]}"


def test_control_text_folder_trains(tmp_path):
    p, _ = _text_train(tmp_path, _text_folder(tmp_path / "text", 6), "ok")
    _one_line(p, 0)


def test_text_client_with_a_token_beyond_the_vocabulary_is_one_line(tmp_path):
    p, _ = _text_train(tmp_path, _text_folder(tmp_path / "bad", 6, bad=3), "bad")
    _one_line(p, 2)
    assert "skipping client" not in p.stderr


def test_evaluate_data_with_a_token_beyond_the_vocabulary_is_one_line(tmp_path):
    p, run = _text_train(tmp_path, _text_folder(tmp_path / "text", 6), "ok")
    _one_line(p, 0)
    new = _text_folder(tmp_path / "new", 2, bad=1, seed=1)
    q = _cli(tmp_path, "evaluate", str(run), "--data", str(new))
    _one_line(q, 2)


CACHE_MODEL = '''
import torch
from torch import nn


class Cache(nn.Module):
    def __init__(self, k=3):
        super().__init__()
        self.a, self.b = nn.Linear(16, 6), nn.Linear(6, k)
        self.scale = self.a.bias.sum() * 0 + 1.0  # a cached non-leaf tensor (requires grad)

    def forward(self, x):
        return self.b(torch.relu(self.a(x.flatten(1)))) * self.scale.detach()


def cache(num_classes: int = 3):
    return Cache(num_classes)
'''


def _cache_train(tmp_path, method: str):
    (tmp_path / "usermodels.py").write_text(textwrap.dedent(CACHE_MODEL))
    data = client_folder(tmp_path / "data", clients=6)
    cfg = tiny_toml(tmp_path / "cfg.toml", "usermodels:cache", data)
    return _cli(tmp_path, "train", str(cfg), "--allow-code", "--out",
                str(tmp_path / "runs" / method), "--set", "backend.name=processes",
                "--set", "backend.workers=2", "--set", f"backend.start_method={method}")


def test_control_fork_pool_with_a_cached_tensor_model_runs(tmp_path):
    _one_line(_cache_train(tmp_path, "fork"), 0)


def test_spawn_pool_with_a_non_leaf_tensor_attribute_is_one_line(tmp_path):
    p = _cache_train(tmp_path, "spawn")
    _one_line(p, 2)
    assert "skipping client" not in p.stderr


NOCHILD_MODEL = '''
import torch
from torch import nn


class NoChild(nn.Module):
    def __init__(self, k=3):
        super().__init__()
        self.a, self.b = nn.Linear(16, 6), nn.Linear(6, k)

    def forward(self, x):
        return self.b(torch.relu(self.a(x.flatten(1))))

    def __setstate__(self, state):  # unpickling fails (only a worker unpickles the run)
        raise RuntimeError("cannot rebuild in a child")


def nochild(num_classes: int = 3):
    return NoChild(num_classes)
'''


def test_spawn_pool_whose_workers_cannot_start_is_one_line(tmp_path):
    (tmp_path / "usermodels.py").write_text(NOCHILD_MODEL)
    data = client_folder(tmp_path / "data", clients=6)
    cfg = tiny_toml(tmp_path / "cfg.toml", "usermodels:nochild", data)
    p = _cli(tmp_path, "train", str(cfg), "--allow-code", "--out", str(tmp_path / "runs" / "n"),
             "--set", "backend.name=processes", "--set", "backend.workers=2",
             "--set", "backend.start_method=spawn")
    last = p.stderr.strip().splitlines()[-1:]
    assert p.returncode in (1, 2) and last and last[0].startswith("partialfl:"), \
        f"exit {p.returncode}: {last}"
    assert "Traceback (most recent call last):\n  File \"<frozen runpy>\"" not in p.stderr
