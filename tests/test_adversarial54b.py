"""Adversarial round 54b (issue 21, areas 1, 3, 4, 7 and 8, tried again from scratch by
someone who did not write the fixes, against c987f45), entered through a researcher's OWN
model and data (``model.name = "module:callable"`` with ``--allow-code``, a ``folder`` of
per-client ``.npz`` files). Each test failed on that code because of the defect it names,
and passes since the fix: a client's labels of another per-example shape are refused by
``FederatedDataset``; ``evaluate --data`` checks the new clients' examples and labels
against the run's model; the ``vmap`` backend's build check runs the model under
``torch.func.vmap``; a worker pool that cannot pickle the run stops it in one line
(``RunSetupError``, never counted as client failures); held-out clients without a test
example are refused before anything trains.

* Area 8 (files), a client file whose labels have another per-example shape than the other
  clients' (``y`` of shape ``[n, 2]`` in one ``CLIENT.npz``, ``[n]`` in the others: a
  researcher's export gone wrong) is accepted by the ``folder`` source and by
  :class:`partialfl.data.federated.FederatedDataset` (which checks that every client's ``x``
  has the first client's per-example shape and dtype, but checks ``y`` only for its first
  dimension and its label range), and ``partialfl train`` then ends in a traceback, exit 1:
  ``RuntimeError: Tensors must have same number of dimensions: got 1 and 2`` from
  ``torch.cat`` in :class:`partialfl.problems.model.data.FlatSplit`. The same file passed
  to ``partialfl evaluate RUN --data DIR`` ends the same way. Expected: one line naming the
  client, exit 2 (as for an ``x`` of another shape: "train_x of client 'user9' has
  per-example shape ..."). Suspected root cause: ``FederatedDataset.__post_init__`` (no
  check of ``y``'s per-example shape against the first client's).
* Area 8 (files), ``partialfl evaluate RUN --data DIR`` with new clients' data that does not
  fit the run's model ends in a traceback, exit 1 (after printing nothing useful):

  - labels beyond the run's classes (the run trained 3 classes, the new clients' files hold
    labels up to 5): ``IndexError: Target 3 is out of bounds.`` from ``cross_entropy``;
  - images of another size (5×5 instead of 4×4): ``RuntimeError: mat1 and mat2 shapes
    cannot be multiplied (2x25 and 16x6)`` from the model (a GroupNorm/LayerNorm model:
    ``Given normalized_shape=[16] ...``);
  - integer inputs where the run had images: ``RuntimeError: mat1 and mat2 must have the
    same dtype, but got Long and Float`` (a conv model: ``Input type (long int) and bias
    type (float) should be the same``).

  ``partialfl train`` refuses the same misfits in one line, exit 2, before anything runs
  (``model: does not fit the data (...)``, :func:`partialfl.build.run._check_forward`); the
  ``--data`` path reads the files with ``build_data`` and hands them to ``evaluate_run``
  unchecked. Suspected root cause:
  :func:`partialfl.pipeline.train.evaluate_train_run` (no check of the new data's classes,
  per-example shape and dtype against the run's model / training data).
* Area 8, ``backend = "vmap"`` with a user's model that ``torch.func.vmap`` cannot batch (an
  ``nn.GRU``: "Batching rule not implemented for aten::gru.input") is accepted by
  ``partialfl train --dry-run`` ("dry run: nothing trained, nothing written", exit 0) and by
  the run's start, which then dies in stage 1 with a torch traceback, exit 1, leaving a
  half-made run folder. docs/config.md: ``backend`` — "how a cohort's clients run
  (sequential, vmap, processes; all give the same θ)"; the sequential, ``threads`` and
  ``processes`` backends train the same model bit for bit alike. Expected: the
  combination refused in one line (exit 2, best already by ``--dry-run``), or the run
  finishing. Suspected root cause: the build's model check
  (:func:`partialfl.build.run._check_forward`) runs the model plainly, never as the chosen
  executor will (``problems/model/passes.py`` ``_pass_vmap``).
* Area 1/8, ``backend = { name = "processes", start_method = "spawn" }`` (also
  ``forkserver``; ``spawn`` is the default on a machine where torch sees a GPU) with a user's
  model holding a lambda (``self.act = lambda t: torch.relu(t)``: not picklable) prints
  "skipping client 1 in round 0: it failed (AttributeError: Can't pickle local object ...)"
  for the cohort's clients — the pool's own start counted as client failures — and then
  ends in a traceback, exit 1 (``AttributeError`` out of
  :meth:`partialfl.runtime.pool.WorkerPool._spawn`). Expected: one line naming the cause
  (the model cannot be sent to worker processes started by spawn), exit 2, no client
  reported as failed. Suspected root cause: ``WorkerPool.__init__`` / ``_spawn`` (the
  pickling error of ``Process.start`` neither turned into a configuration error nor kept
  apart from client faults).
* Area 8 (a run that can never finish), a client folder holding a client file with no
  examples (the README: "A client may have zero test (or train) examples"; here 6 clients
  plus ``user90``..``user92`` with empty ``x``/``y``) and ``holdout = 1``: the seeded
  hold-out draws ``user90``, and ``partialfl train`` pre-trains, personalizes, fine-tunes,
  writes ``deploy.safetensors`` and ``metrics.json``, then ends with ``partialfl: error: no
  example to evaluate on (every client has total = 0)``, exit 2, no ``report.md``. Every
  rerun resumes and fails the same way, ``partialfl report RUN`` refuses ("holds a run that
  has not finished (interrupted): resume it first"), ``evaluate`` fails as well; ``--dry-run``
  accepts the config ("nothing trained"). The user cannot choose which clients the seed holds
  out. The same happens when the held-out file holds ONE example (``x, y`` files are split
  per client with ``test_fraction``: one example gives no test example). Expected: the run
  refused before it trains (one line: the held-out clients have no test examples), or finishing
  with its new-client evaluation reported as empty. Suspected
  root cause: :func:`partialfl.pipeline.train` / ``_subset_holdout`` (held-out clients never
  checked for test examples before training; the final new-client evaluation raises).

Tried and held (run unless marked "read"): user models named by a config — ``nn.GroupNorm``
+ ``nn.LayerNorm`` CNN, ``nn.Dropout`` (off during training, as documented in
``problems/model``; the sequential, ``threads``, ``processes`` and ``vmap`` backends give the
same θ bit for bit), an ``nn.GRU`` model and a one-layer ``nn.TransformerEncoderLayer``
(sequential, ``threads``, ``processes``: θ bit-exact with sequential; vmap within 6e-8 for the
transformer), a model with a long buffer incremented in its forward and a float ``scale``
buffer (constants of the module, not in ``w``; every backend but vmap — an in-place buffer
update under ``torch.func`` is the same vmap defect), a ``channels_last`` conv model, a
model with non-contiguous (transposed) parameters; a model whose forward returns a tuple or
a dict (one line, exit 2: "does not fit the data"); ``nn.LazyLinear`` (one line, exit 2);
``evaluate``, ``report``, ``compare`` and ``advise CONFIG --allow-code`` on those runs;
``PersonalizedModels.load`` / ``load_personalized`` of every such run (the state dict equal
to the saved θ and w_m, the module in eval mode); a study ``--seeds 0 1 --sweep
method.split=output,norm`` with its ``compare`` and ``evaluate``; user data: every label
the same class (runs, 100%), a client file with no examples, with one example, with
``train_x`` empty or ``test_x`` empty (runs), a NaN input (one line), a label −1 (one
line), a label 2⁴⁰ (one line: at most 1,048,576 classes), a label beyond the other clients'
(num_classes grows; runs), integer inputs beside images and images of another size (one
line each); ``evaluate --data`` of clients with no examples (one line); labels as a column
``[n, 1]`` in every file (one line), ``data.options.num_classes`` below the labels (one line);
``advise
CONFIG`` on data with empty, one-example and one-class clients; the toy plugin's
``drop-largest`` rule (``plugins = ["toy_plugin"]``) under ``[attack]`` with 40% Byzantine
clients on a user model (runs with the ``UnprotectedWarning`` "a rule that states no
tolerance ... tolerates none", as ``algorithms/byzantine.py`` documents); the Python API
``advisor.advise`` on a LayerNorm/Dropout model (runs), a Lazy model and a GRU (exceptions,
as an API may).
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from _adv_cli import env
from _user_project import client_folder, tiny_toml

MODELS = '''
import torch
from torch import nn


def mlp(num_classes: int = 3):
    return nn.Sequential(nn.Flatten(), nn.Linear(16, 6), nn.ReLU(), nn.Linear(6, num_classes))


class Rnn(nn.Module):  # reads a 4x4 image as 4 steps of 4 features
    def __init__(self, k=3):
        super().__init__()
        self.r, self.o = nn.GRU(4, 5, batch_first=True), nn.Linear(5, k)

    def forward(self, x):
        h, _ = self.r(x.reshape(x.shape[0], 4, 4))
        return self.o(h[:, -1])


def rnn(num_classes: int = 3):
    return Rnn(num_classes)


class Lam(nn.Module):
    def __init__(self, k=3):
        super().__init__()
        self.f, self.a, self.b = nn.Flatten(), nn.Linear(16, 6), nn.Linear(6, k)
        self.act = lambda t: torch.relu(t)

    def forward(self, x):
        return self.b(self.act(self.a(self.f(x))))


def lam(num_classes: int = 3):
    return Lam(num_classes)
'''


def _train(tmp_path, model: str, *extra: str, data=None, timeout: float = 170):
    (tmp_path / "usermodels.py").write_text(MODELS)
    data = data or client_folder(tmp_path / "data", clients=6)
    cfg = tiny_toml(tmp_path / "cfg.toml", f"usermodels:{model}", data)
    out = tmp_path / "runs" / model
    p = subprocess.run([sys.executable, "-m", "partialfl", "train", str(cfg), "--allow-code",
                        "--out", str(out), "--no-progress", *extra], cwd=tmp_path,
                       env=env(None), capture_output=True, text=True, timeout=timeout)
    return p, out


def _evaluate(tmp_path, run, data):
    return subprocess.run([sys.executable, "-m", "partialfl", "evaluate", str(run),
                           "--allow-code", "--data", str(data), "--no-progress"],
                          cwd=tmp_path, env=env(None), capture_output=True, text=True,
                          timeout=170)


def _one_line(p, rc: int = 2) -> None:
    assert p.returncode == rc and "Traceback" not in p.stderr, \
        f"exit {p.returncode}: {p.stderr.strip().splitlines()[-1:]}"


def _seq_labels(d):
    """One more client whose labels are [n, 2] (the others' are [n])."""
    np.savez(d / "user9.npz", x=np.zeros((5, 4, 4), np.uint8), y=np.zeros((5, 2), np.int64))
    return d


def test_control_a_client_with_other_input_shape_is_one_line(tmp_path):
    data = client_folder(tmp_path / "data", clients=6)
    np.savez(data / "user9.npz", x=np.zeros((5, 5, 5), np.uint8), y=np.zeros(5, np.int64))
    p, _ = _train(tmp_path, "mlp", data=data)
    _one_line(p)
    assert "per-example shape" in p.stderr


def test_a_client_with_other_label_shape_is_one_line(tmp_path):
    """Found: exit 1, ``RuntimeError: Tensors must have same number of dimensions: got 1 and
    2`` (traceback). Expected: one line naming the client, exit 2."""
    data = _seq_labels(client_folder(tmp_path / "data", clients=6))
    p, _ = _train(tmp_path, "mlp", data=data)
    _one_line(p)


@pytest.fixture
def trained(tmp_path):
    p, out = _train(tmp_path, "mlp")
    assert p.returncode == 0, p.stderr[-600:]
    return out


def _new_clients(root, *, classes=3, shape=(4, 4), dtype=np.uint8):
    rng = np.random.default_rng(0)
    root.mkdir()
    for m in range(2):
        y = rng.integers(0, classes, 10)
        y[0] = classes - 1
        np.savez(root / f"new{m}.npz", x=rng.integers(0, 200, (10, *shape)).astype(dtype), y=y)
    return root


def test_control_evaluate_data_that_fits(tmp_path, trained):
    p = _evaluate(tmp_path, trained, _new_clients(tmp_path / "new"))
    assert p.returncode == 0, p.stderr[-600:]


@pytest.mark.parametrize("misfit", ["classes", "shape", "dtype"])
def test_evaluate_data_that_does_not_fit_the_model_is_one_line(tmp_path, trained, misfit):
    """Found: exit 1, ``IndexError: Target 3 is out of bounds`` / ``RuntimeError: mat1 and
    mat2 shapes cannot be multiplied`` / ``... must have the same dtype`` with tracebacks.
    Expected: one line, exit 2 (as ``train`` refuses the same misfits)."""
    kw = {"classes": {"classes": 6}, "shape": {"shape": (5, 5)},
          "dtype": {"dtype": np.int64}}[misfit]
    p = _evaluate(tmp_path, trained, _new_clients(tmp_path / "new", **kw))
    _one_line(p)


def test_evaluate_data_with_other_label_shape_is_one_line(tmp_path, trained):
    p = _evaluate(tmp_path, trained, _seq_labels(_new_clients(tmp_path / "new")))
    _one_line(p)


def test_control_gru_model_trains_sequentially(tmp_path):
    p, out = _train(tmp_path, "rnn")
    assert p.returncode == 0, p.stderr[-600:]
    assert (out / "report.md").is_file()


def test_vmap_backend_with_a_gru_model_is_refused_or_runs(tmp_path):
    """Found: ``--dry-run`` exit 0, then the run exit 1 with a traceback. Expected: the run
    finishes, or both refuse in one line, exit 2."""
    dry, _ = _train(tmp_path, "rnn", "--set", "backend=vmap", "--dry-run")
    p, out = _train(tmp_path, "rnn", "--set", "backend=vmap")
    if p.returncode == 0:
        assert (out / "report.md").is_file()
        return
    _one_line(p)
    _one_line(dry)


def test_spawn_pool_with_an_unpicklable_model_is_one_line(tmp_path):
    """Found: "skipping client 1 in round 0: it failed (AttributeError: Can't pickle local
    object ...)" lines, then ``AttributeError`` with a traceback, exit 1. Expected: one line
    naming the cause, exit 2, no client reported as failed."""
    p, _ = _train(tmp_path, "lam", "--set",
                  'backend={name="processes",workers=2,start_method="spawn"}')
    assert "skipping client" not in p.stderr
    _one_line(p)


def test_control_fork_pool_with_the_same_model_runs(tmp_path):
    p, out = _train(tmp_path, "lam", "--set",
                    'backend={name="processes",workers=2,start_method="fork"}')
    assert p.returncode == 0, p.stderr[-600:]


def test_an_empty_held_out_client_does_not_strand_the_run(tmp_path):
    """Found: exit 2 after training, no report.md. Expected: refused before training (nothing
    trained) or the run finishing (report.md)."""
    data = client_folder(tmp_path / "data", clients=6)
    for i in range(3):
        np.savez(data / f"user9{i}.npz", x=np.zeros((0, 4, 4), np.uint8),
                 y=np.zeros((0,), np.int64))
    p, out = _train(tmp_path, "mlp", data=data)
    if p.returncode == 0:
        assert (out / "report.md").is_file()
        return
    _one_line(p)
    assert not (out / "deploy.safetensors").exists() and not (out / "stage1").exists(), \
        f"refused only after training: {p.stderr.strip().splitlines()[-1]}"
