"""Adversarial round 53b (issue 21, areas 1, 3, 4, 7 and 8, tried again from scratch by
someone who did not write the fixes, against 16cb053). Each test failed on that code because
of the defect it names, and passes since the fix: ``deploy.safetensors``'s ``w_pretrained``
is checked against the personal parameters and the running statistics the problem keeps;
the build's model check runs one example in evaluation mode (a BatchNorm fits, its
statistics stay put) and refuses parameters with ``requires_grad=False`` in one line.

* Area 8 (files), found by training a user's own model with BatchNorm — the model of the
  README's own example (``MyNet``: ``nn.Conv2d`` + ``nn.BatchNorm2d`` + a linear head) named
  by a config (``model.name = "usermodels:mynet"``, ``--allow-code``): ``partialfl train``
  pre-trains, personalizes, fine-tunes and writes ``deploy.safetensors``, then ends with
  ``partialfl: error: OUT/deploy.safetensors: w_pretrained/ does not fit the model's split
  (['bn.num_batches_tracked', 'bn.running_mean', 'bn.running_var'])``, exit 2, no
  ``report.md``, no ``metrics.json`` of the new clients — and every rerun fails the same way.
  The README says "BatchNorm running statistics are personal client state under every split"
  (they travel in w); :func:`partialfl.pipeline.files.save_deploy` writes them under
  ``w_pretrained/``, but :func:`partialfl.pipeline.files.deployed_split` checks that group
  against the split's personal *parameters* only (``{n: own[n] for n in
  split.personal_names}`` from ``named_parameters()``), so every model with buffers in w is
  refused by its own run. Suspected root cause: ``deployed_split``'s expected names for
  ``w_pretrained`` (parameters, not the personal state the problem keeps).
* Area 8, a user's MLP with ``nn.BatchNorm1d`` (``Flatten, Linear(16, 6), BatchNorm1d(6),
  ReLU, Linear(6, 3)``) is refused by every ``partialfl train`` / ``--dry-run`` with
  ``model: does not fit the data (inputs (1, 4, 4) torch.float32, 3 classes): Expected more
  than 1 value per channel when training, got input size torch.Size([1, 6])`` (one line,
  exit 2) — although the model fits the data: with the probe skipped the same run trains
  all three stages on batches of 8 (and then meets the defect above). The probe
  :func:`partialfl.build.run._check_forward` passes ONE example through the model in
  training mode (BatchNorm1d needs two per channel in training mode; it also moves the
  model's running statistics). Suspected root cause: ``_check_forward`` (one example, train
  mode; two examples or ``eval()`` would test the fit without that artefact).
* Area 8 (a user model changed without a word), a user's model with a frozen layer
  (``m[1].weight.requires_grad_(False)``: PyTorch's way to say "do not train this", e.g. a
  pre-trained feature layer) is trained anyway: ``partialfl train`` reports it among the
  model's parameters, sends it as part of θ, and every stage moves it (between stage 1's
  ``theta.safetensors`` and ``theta_stage2.safetensors`` ``1.weight`` moves by up to 4.6e-3)
  — no refusal, no warning. The client passes make every leaf of θ / w a fresh
  ``requires_grad_(True)`` tensor (``problems/model/passes.py``, ``kernels.py``, ``head.py``)
  and the split (``partialfl.split``) never looks at ``requires_grad``. Suspected root
  cause: the split / problem building ignore ``Parameter.requires_grad`` (a frozen
  parameter should be a constant of the model, or the model refused in one line).

Tried and held (run unless marked "read"): user models named by a config (``--allow-code``)
— a module used twice (tied modules), a weight tied across two layers and across the
output split (``out.weight = mid.weight``), a ``ModuleDict`` with a ``-`` in a key plus
float and int64 buffers, ``pattern`` splits on tied / dashed names — through ``train``
(sequential, ``processes`` fork/spawn/forkserver: θ and every client's w bit-exact with
sequential, also for the BatchNorm model), ``evaluate``, ``report``, ``compare``,
``advise`` (with and without ``--theta``; another model's θ: one line),
``PersonalizedModels.load`` / ``load_personalized`` (ties and buffers restored); float64 and
bfloat16 models (one line: the data is float32); a model whose forward ``os._exit``s,
SIGKILLs itself, sleeps (``task_timeout`` 5: killed, counted), returns inf (counted
non-finite) in worker processes: one line, exit 1, seconds; one that raises in every
client (re-raised as the user's own bug, as documented); kill -9 of ``train`` before each of
its 28 ``os.replace`` calls, then the same command again: the same θ₂, personalized files
and metrics as an uninterrupted run, no temporary file left (before ``run_files.json``: a
finished run refused as documented; ``report``, ``evaluate``, ``compare`` and
``--overwrite`` work on it); kill -9 of ``report``, ``report --tensorboard``, ``compare
--out``, ``evaluate --json`` at 8 instants each (nothing stray, one events file, reruns
fine, ``--overwrite`` removes ``tensorboard/``); kill -9 of a ``--seeds 0 1 --jobs 2``
study driver (its worker processes end with it); umask 027 over train / evaluate ``--json``
/ compare (every file 640, folder 750); two stores sharing every file by hard links, then
``data convert --overwrite`` of each (the other store unchanged and still verified);
``--set`` seed / pretrain_seed 2⁶⁴ / −1 / 1e3, threads 0 / 10⁹, rounds / batch_size /
epochs / eval_every 10²⁰ (one line, exit 2) and 2⁶³−1 (runs; long ones stopped by the
timeout), lr 1e308 / 5e-324, clip_norm 1e-320 / 1e308, server lr 1e400 (refused); a robust
rule with the Byzantine fraction above δ (refused), bucketing s·δ ≥ ½ (refused), Krum at
k = 2f+3. Observed, not filed: a fine-tuning lr of 1e308 ends "the run diverged ... (lower
the learning rates: personalize.server.lr, personalize.client.lr)" — the stage that
diverged was stage 3; a stage-2 divergence ends with "deploy.safetensors: theta/… is not
all finite" (exit 2) after the divergence warnings.
"""

from __future__ import annotations

import subprocess
import sys

from _adv_cli import env
from _user_project import client_folder, tiny_toml

FROZEN_MODEL = '''
from torch import nn


def fixedfeat(num_classes: int = 3):
    m = nn.Sequential(nn.Flatten(), nn.Linear(16, 6), nn.ReLU(), nn.Linear(6, num_classes))
    m[1].weight.requires_grad_(False)  # the user's frozen feature layer
    return m
'''

BN1D_MODEL = '''
from torch import nn


def bn1d(num_classes: int = 3):
    return nn.Sequential(nn.Flatten(), nn.Linear(16, 6), nn.BatchNorm1d(6), nn.ReLU(),
                         nn.Linear(6, num_classes))
'''

BN_MODEL = '''
import torch
from torch import nn


class MyNet(nn.Module):  # the README's CNN with BatchNorm, on 4x4 images
    def __init__(self, num_classes=3):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(1, 8, 3), nn.BatchNorm2d(8)
        self.head = nn.Linear(8 * 2 * 2, num_classes)

    def forward(self, x):
        if x.dim() == 3:
            x = x.unsqueeze(1)
        return self.head(torch.relu(self.bn(self.conv(x))).flatten(1))


def mynet(num_classes: int = 3):
    return MyNet(num_classes)
'''


def test_train_user_batchnorm_model_finishes(tmp_path):
    """Found: exit 2, "deploy.safetensors: w_pretrained/ does not fit the model's split
    (['bn.num_batches_tracked', ...])" after all three stages ran. Expected: the run
    finishes (exit 0, report.md written)."""
    (tmp_path / "usermodels.py").write_text(BN_MODEL)
    data = client_folder(tmp_path / "data", clients=6)
    cfg = tiny_toml(tmp_path / "cfg.toml", "usermodels:mynet", data)
    out = tmp_path / "runs" / "bn"
    p = subprocess.run([sys.executable, "-m", "partialfl", "train", str(cfg), "--allow-code",
                        "--out", str(out)], cwd=tmp_path, env=env(None),
                       capture_output=True, text=True, timeout=170)
    assert p.returncode == 0, p.stderr[-600:]
    assert (out / "report.md").is_file()


def test_dry_run_accepts_user_batchnorm1d_model(tmp_path):
    """Found: exit 2, "model: does not fit the data (inputs (1, 4, 4) ...): Expected more
    than 1 value per channel when training". Expected: the dry run accepts the model
    (exit 0)."""
    (tmp_path / "usermodels.py").write_text(BN1D_MODEL)
    data = client_folder(tmp_path / "data", clients=6)
    cfg = tiny_toml(tmp_path / "cfg.toml", "usermodels:bn1d", data)
    p = subprocess.run([sys.executable, "-m", "partialfl", "train", str(cfg), "--allow-code",
                        "--out", str(tmp_path / "runs" / "bn1d"), "--dry-run"],
                       cwd=tmp_path, env=env(None), capture_output=True, text=True,
                       timeout=170)
    assert p.returncode == 0, p.stderr[-600:]


def test_frozen_user_parameter_is_not_trained_silently(tmp_path):
    """Found: exit 0, no warning, ``1.weight`` differs between stage 1's θ and stage 2's θ.
    Expected: the frozen leaf stays as it was (or the model is refused / the user warned)."""
    from safetensors.torch import load_file

    (tmp_path / "usermodels.py").write_text(FROZEN_MODEL)
    data = client_folder(tmp_path / "data", clients=6)
    cfg = tiny_toml(tmp_path / "cfg.toml", "usermodels:fixedfeat", data)
    out = tmp_path / "runs" / "ff"
    p = subprocess.run([sys.executable, "-m", "partialfl", "train", str(cfg), "--allow-code",
                        "--out", str(out)], cwd=tmp_path, env=env(None),
                       capture_output=True, text=True, timeout=170)
    said = "requires_grad" in p.stderr + p.stdout  # (tmp_path names the test: "frozen")
    if p.returncode == 2 or said:
        return  # refused or warned: the user knows
    assert p.returncode == 0, p.stderr[-600:]
    a = load_file(str(out / "stage1" / "theta.safetensors"))["1.weight"]
    b = load_file(str(out / "theta_stage2.safetensors"))["1.weight"]
    assert bool((a == b).all()), f"frozen 1.weight moved by {(a - b).abs().max().item():.3g}"
