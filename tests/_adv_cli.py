"""What the CLI adversarial tests share (rounds 31b, 39b–43b): a small FEMNIST training config,
the ``partialfl`` command run in a child process on this checkout's ``src`` (code opt-in
cleared), and the same command killed with SIGKILL at one file-system call on a given path —
the instant is then the same on every machine."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[1] / "src")


def femnist_toml(name: str = "ow", *, stages: str = '["personalize"]', lr: object = 0.05,
                 rounds: int = 1, clients_per_round: int = 4, batch_size: int = 32,
                 client_lr: float = 0.01, eval_every: bool = True, finetune: bool = True,
                 pretrain_lr: object = None) -> str:
    """A run config on 4 FEMNIST writers, the EMNIST CNN with its output layer personal, FFGG
    with server learning rate ``lr`` (``pretrain_lr``: a ``[pretrain]`` table, FedAvg's
    server learning rate)."""
    ev = "eval_every = 1\n" if eval_every else ""
    pre = "" if pretrain_lr is None else (
        f"[pretrain]\nrounds = 1\nclients_per_round = 4\neval_every = 1\n"
        f"client = {{ lr = 0.3, epochs = 1, batch_size = 32 }}\n"
        f"server = {{ optimizer = \"sgd\", lr = {pretrain_lr} }}\n")
    ft = (f"[finetune]\nlr = 0.01\nepochs = 1\nbatch_size = {batch_size}\n" if finetune
          else "")
    return (f'name = "{name}"\nstages = {stages}\nseed = 0\ndevice = "cpu"\n'
            'backend = "sequential"\n[model]\nname = "emnist_cnn"\n[data]\nsource = "femnist"\n'
            'num_clients = 4\nholdout = 0\n[method]\nalgorithm = "ffgg"\nsplit = "output"\n'
            f"{pre}[personalize]\nrounds = {rounds}\nclients_per_round = {clients_per_round}\n"
            f"{ev}client = {{ lr = {client_lr}, epochs = 1, batch_size = {batch_size} }}\n"
            f'server = {{ optimizer = "sgd", lr = {lr} }}\n{ft}'
            "[logging]\ntensorboard = false\nprogress = false\n")


# the paper's least-squares problem (Example 1): 8 clients, 3 FFGG rounds of full
# participation with 3 local GD steps — a closed-form run in well under a second
LS_TOML = """name = "ls"
[problem]
name = "least-squares"
num_clients = 8
n = 200
d_theta = 5
d_w = 3
[method]
algorithm = "ffgg"
[personalize]
rounds = 3
clients_per_round = 0
client = { name = "gd", tau = 3 }
"""

# a smaller one for the Flower engines: 4 clients, 2 rounds of 3 CG steps from w = 0
LS_SMALL_TOML = """name = "ls"
seed = 3
[problem]
name = "least-squares"
num_clients = 4
n = 50
d_theta = 4
d_w = 2
seed = 3
[method]
algorithm = "ffgg"
w_init = "zero"
[personalize]
rounds = 2
client = { name = "cg", tau = 3 }
"""


def env(data_dir, **extra) -> dict[str, str]:
    """This environment with ``src`` first, ``PARTIALFL_DATA_DIR`` (unless ``data_dir`` is
    None) and ``extra``; the code opt-in removed."""
    out = {**os.environ, "PYTHONPATH": SRC, **extra}
    if data_dir is not None:
        out["PARTIALFL_DATA_DIR"] = str(data_dir)
    out.pop("PARTIALFL_ALLOW_CODE", None)
    return out


def cli(cwd: Path, data_dir, *args: str, timeout: float = 170.0):
    """``python -m partialfl ARGS`` in ``cwd``: the finished process (text output)."""
    return subprocess.run([sys.executable, "-m", "partialfl", *args], cwd=cwd,
                          env=env(data_dir), capture_output=True, text=True, timeout=timeout)


# a driver that SIGKILLs itself at the file-system call KILL_CALL (os.replace: on its
# destination, os.unlink) on the path ending in KILL_PATH (a study with --jobs 1 runs in this
# process)
_KILL_AT = """\
import os, signal, sys
if __name__ == "__main__":  # (not in the spawned workers that re-import this file)
    what, tail = os.environ["KILL_CALL"], os.environ["KILL_PATH"]
    def hooked(real, arg):
        def f(p, *a, **k):
            if os.path.abspath(str(p if arg == 0 else a[0])).endswith(tail):
                os.kill(os.getpid(), signal.SIGKILL)
            return real(p, *a, **k)
        return f
    if what == "unlink":
        os.unlink = hooked(os.unlink, 0)
    elif what == "replace":
        os.replace = hooked(os.replace, 1)
    import partialfl.cli as cli
    sys.exit(cli.main(sys.argv[1:]))
"""


def killed(cwd: Path, data_dir, call: str, tail: str, *args: str):
    """:func:`cli` killed (SIGKILL) at the ``call`` (``"replace"`` or ``"unlink"``) on the
    path ending in ``tail``."""
    if call not in ("replace", "unlink"):
        raise ValueError(f"call must be 'replace' or 'unlink', got {call!r}")
    (cwd / "kill_at.py").write_text(_KILL_AT)
    return subprocess.run([sys.executable, str(cwd / "kill_at.py"), *args], cwd=cwd,
                          env=env(data_dir, KILL_CALL=call, KILL_PATH=tail),
                          capture_output=True, text=True, timeout=170)


def trained_user_run(root: Path) -> Path:
    """``root`` holding a user's model module, 6 clients' data, ``a.toml`` and the finished
    ``partialfl train`` run ``runs/a`` (rounds 59b/60b attack what it wrote)."""
    from _user_project import TINY_MODEL, client_folder, tiny_toml

    (root / "usermodels.py").write_text(TINY_MODEL)
    data = client_folder(root / "data", clients=6)
    cfg = tiny_toml(root / "a.toml", "usermodels:tiny", data, name="a")
    p = cli(root, None, "train", str(cfg), "--allow-code", "--out", str(root / "runs" / "a"))
    assert p.returncode == 0, p.stderr[-600:]
    return root


def copy_run(root: Path, name: str) -> Path:
    """A fresh copy ``runs/NAME`` of :func:`trained_user_run`'s ``runs/a``."""
    import shutil

    run = root / "runs" / name
    shutil.rmtree(run, ignore_errors=True)
    shutil.copytree(root / "runs" / "a", run)
    return run


def evaluate_json(root: Path, run: Path, target: str):
    """``partialfl evaluate runs/RUN --json TARGET`` in ``root``."""
    return cli(root, None, "evaluate", f"runs/{run.name}", "--allow-code", "--no-progress",
               "--json", target)
