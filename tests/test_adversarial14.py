"""Adversarial round 14 (issue 21): regression tests for what the fourteenth independent round
found, in the GLDv2, TFF-EMNIST and StackOverflow readers behind ``partialfl data convert``.

Found, before, now:

* A GLDv2 CSV with ``image_id`` ``../../elsewhere/x`` or ``/abs/path/x`` read images outside the
  image folder into the store (exit 0). Now an image id must be a plain file name.
* A GLDv2 CSV field over the csv module's limit and a decompression-bomb image (a small file
  declaring 400 M pixels) were ``_csv.Error`` / ``DecompressionBombError`` tracebacks. Now one
  line naming the file.
* An explicit client id that the input does not hold (``--option clients='["x"]'``) was a
  KeyError traceback from every loader. Now one line, exit 2.
* TFF h5 files: an *external link* (or a virtual dataset / external raw storage) made the
  loader read another file on the machine into the store (exit 0); a ``pixels`` group was a
  TypeError traceback; complex pixels lost their imaginary part silently. Now refused by name
  (:mod:`partialfl.data.hdf5`).
* StackOverflow: ``max_test = -1`` silently dropped each client's last test sentence (a
  negative slice); a word count ``²`` (``str.isdigit`` but not ``int``) gave a message not
  naming the file. Now one line naming the option / file and line.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_adversarial import _run

h5py = pytest.importorskip("h5py")


def _gldv2(tmp_path, rows: str):
    Image = pytest.importorskip("PIL.Image")
    img = tmp_path / "img"
    img.mkdir()
    for i in range(4):
        Image.new("RGB", (4, 4), (i * 40, 0, 0)).save(img / f"im{i}.jpg")
    csv = tmp_path / "split.csv"
    csv.write_text("user_id,image_id,class\n" + rows)
    return csv, img


@pytest.mark.parametrize("image", ["../outside/secret", "/tmp/outside/secret", "..", "a\\b"])
def test_gldv2_image_id_must_stay_in_the_image_folder(tmp_path, capsys, image):
    Image = pytest.importorskip("PIL.Image")
    (tmp_path / "outside").mkdir()
    Image.new("RGB", (4, 4)).save(tmp_path / "outside" / "secret.jpg")
    csv, img = _gldv2(tmp_path, f"u1,im0,0\nu1,{image},1\nu2,im2,0\n")
    rc, err = _run(["data", "convert", "gldv2", csv, tmp_path / "s", "--images", img,
                    "--no-progress", "--option", "missing_images=skip"], capsys)
    assert rc == 2 and len(err) == 1 and "plain file name" in err[0], err
    assert not (tmp_path / "s").exists()


def test_gldv2_oversized_csv_field_and_image_bomb_are_one_line(tmp_path, capsys):
    Image = pytest.importorskip("PIL.Image")
    csv, img = _gldv2(tmp_path, "u1,im0,0\nu1," + "a" * 200_000 + ",1\n")
    rc, err = _run(["data", "convert", "gldv2", csv, tmp_path / "s", "--images", img,
                    "--no-progress"], capsys)
    assert rc == 2 and len(err) == 1 and "split.csv" in err[0], err
    csv.write_text("user_id,image_id,class\nu1,im0,0\nu1,im1,1\n")
    Image.new("1", (20_000, 20_000)).save(img / "im1.jpg", format="PNG")  # 400 M pixels
    rc, err = _run(["data", "convert", "gldv2", csv, tmp_path / "s", "--images", img,
                    "--no-progress"], capsys)
    assert rc == 2 and len(err) == 1 and "im1.jpg" in err[0], err


def test_unknown_explicit_client_is_one_line(tmp_path, capsys):
    csv, img = _gldv2(tmp_path, "u1,im0,0\nu1,im1,1\n")
    rc, err = _run(["data", "convert", "gldv2", csv, tmp_path / "s", "--images", img,
                    "--no-progress", "--option", 'clients=["nope"]'], capsys)
    assert rc == 2 and len(err) == 1 and "nope" in err[0], err


def _emnist(folder, make):
    folder.mkdir(exist_ok=True)
    for name in ("fed_emnist_train.h5", "fed_emnist_test.h5"):
        with h5py.File(folder / name, "w") as f:
            make(f.create_group("examples"))
    return folder


def _good_client(g, cid="a"):
    c = g.create_group(cid)
    c["pixels"] = np.random.default_rng(0).random((3, 28, 28)).astype(np.float32)
    c["label"] = np.arange(3)


@pytest.mark.parametrize("kind", ["link_group", "link_dataset", "soft_to_external",
                                  "external_storage"])
def test_tff_h5_never_reads_another_file(tmp_path, capsys, kind):
    other = _emnist(tmp_path / "other", _good_client)
    src = other / "fed_emnist_train.h5"
    secret = tmp_path / "secret.bin"
    secret.write_bytes(bytes(range(10)) * 400)

    def hostile(g):
        if kind == "link_group":
            g["a"] = h5py.ExternalLink(str(src), "/examples/a")
            return
        if kind == "soft_to_external":  # a soft link in the file whose target is external
            g.file["ext"] = h5py.ExternalLink(str(src), "/examples/a")
            g["a"] = h5py.SoftLink("/ext")
            return
        c = g.create_group("a")
        c["pixels"] = np.zeros((1, 28, 28), np.float32)
        if kind == "link_dataset":
            c["label"] = h5py.ExternalLink(str(src), "/examples/a/label")
        else:  # raw bytes of any file, read as labels
            c.create_dataset("label", shape=(1,), dtype="u1", external=[(str(secret), 0, 1)])

    d = _emnist(tmp_path / "in", hostile)
    rc, err = _run(["data", "convert", "tff-emnist", d, tmp_path / "s", "--no-progress"], capsys)
    assert rc == 2 and len(err) == 1 and "examples/a" in err[0], err
    assert "other file" in err[0] or "another file" in err[0], err


@pytest.mark.parametrize("pixels", ["group", "complex", "bytes"])
def test_tff_h5_pixels_must_be_real_numbers(tmp_path, capsys, pixels):
    def hostile(g):
        c = g.create_group("a")
        if pixels == "group":
            c.create_group("pixels")
        elif pixels == "complex":
            c["pixels"] = np.full((1, 28, 28), 0.5 + 1j)
        else:
            c["pixels"] = np.array([b"x"])
        c["label"] = np.arange(1)

    d = _emnist(tmp_path / "in", hostile)
    rc, err = _run(["data", "convert", "tff-emnist", d, tmp_path / "s", "--no-progress"], capsys)
    assert rc == 2 and len(err) == 1 and "examples/a/pixels" in err[0], err


def _stackoverflow(folder, word_count=None, link_to=None):
    folder.mkdir()
    for name in ("stackoverflow_train.h5", "stackoverflow_test.h5"):
        with h5py.File(folder / name, "w") as f:
            g = f.create_group("examples")
            if link_to is not None:
                g["1"] = h5py.ExternalLink(str(link_to / name), "/examples/1")
                continue
            for cid in ("1", "2"):
                g.create_group(cid).create_dataset(
                    "tokens", data=["hello world", "a b c"], dtype=h5py.string_dtype())
    if word_count is not None:
        (folder / "stackoverflow.word_count").write_text(word_count, encoding="utf-8")
    return folder


def _so(folder, tmp_path, capsys, *options):
    argv = ["data", "convert", "stackoverflow", folder, tmp_path / "s", "--no-progress",
            "--option", "min_train=1", "--option", "min_test=1"]
    for o in options:
        argv += ["--option", o]
    return _run(argv, capsys)


def test_stackoverflow_hostile_inputs_are_one_line(tmp_path, capsys):
    good = _stackoverflow(tmp_path / "good")
    rc, err = _so(good, tmp_path, capsys, "max_test=-1")
    assert rc == 2 and err == ["partialfl: error: max_test must be >= 1 or None, got -1"]
    rc, err = _so(good, tmp_path, capsys, 'clients=["9"]')
    assert rc == 2 and len(err) == 1 and "'9'" in err[0], err
    linked = _stackoverflow(tmp_path / "linked", link_to=good)
    rc, err = _so(linked, tmp_path, capsys)
    assert rc == 2 and len(err) == 1 and "another file" in err[0], err
    sup = _stackoverflow(tmp_path / "sup", word_count="hello 5\nworld \u00b2\n")
    rc, err = _so(sup, tmp_path, capsys)
    assert rc == 2 and len(err) == 1 and "word_count:2" in err[0], err
    assert not (tmp_path / "s").exists()


def test_flower_local_with_a_checkpointing_spec_gets_past_its_checks(tmp_path):
    """``flower local`` passes the spec's ``checkpoint_every`` (default 10) to Flower, and every
    engine gives the ServerApp an out-dir; the pre-start check validated without one, so every
    ``partialfl flower local`` of a model run stopped at once ("'checkpoint-every' / 'resume'
    need 'out-dir'", exit 2)."""
    pytest.importorskip("flwr")
    from _flower_sims import ls_spec

    from partialfl.build import build
    from partialfl.flower.train import check_flower_run
    from partialfl.spec import RunSpec

    spec = RunSpec.from_dict(ls_spec(2))
    run = build(spec)
    check_flower_run(run, {"checkpoint-every": spec.checkpoint_every}, 2)  # raised before


def test_an_aborted_flower_run_is_never_a_finished_stage(tmp_path, monkeypatch):
    """A ServerApp that aborts (past max-failure-fraction, e.g. one of two SuperNodes killed)
    still writes result.json and theta.npz and ``flwr run`` exits 0: the report (θ where the
    abort left it, ``aborted: true``) was taken as the finished stage, written as
    ``theta_stage2.safetensors`` and ``flower local`` printed "after 3 + 3 rounds", exit 0."""
    pytest.importorskip("flwr")
    import json
    import subprocess

    from _flower_sims import ls_run

    from partialfl.flower import deployment
    from partialfl.flower.env import FlowerRunError

    def fake_flwr(args, **kw):
        out = Path(next(a.split("=", 1)[1] for a in args if a.startswith("out-dir=")).strip('"'))
        out.mkdir(parents=True, exist_ok=True)
        (out / "result.json").write_text(json.dumps({"summary": {
            "aborted": True, "server_steps": 0,
            "stopped_early": "2 of 3 requested client updates failed"}, "history": []}))
        np.savez(out / "theta.npz", theta=np.zeros(2))
        return subprocess.CompletedProcess(args, 0, "", "")

    monkeypatch.setattr(deployment.subprocess, "run", fake_flwr)
    fed = deployment.LocalFederation(1, simulation=True, work_dir=tmp_path / "w")
    with pytest.raises(FlowerRunError, match="aborted: 2 of 3 requested client updates"):
        fed.run(ls_run(2), out_dir=tmp_path / "o")


def _tiny_train(tmp_path, algorithm="ffgg"):
    d = tmp_path / "clients"
    d.mkdir()
    rng = np.random.default_rng(0)
    for m in range(4):
        np.savez(d / f"u{m}.npz", x=rng.integers(0, 255, (8, 28, 28)).astype(np.uint8),
                 y=rng.integers(0, 3, 8))
    cfg = tmp_path / "t.toml"
    cfg.write_text(f'name = "t"\n[model]\nname = "emnist_cnn"\n[data]\nsource = "folder"\n'
                   f'path = "{d}"\n[method]\nalgorithm = "{algorithm}"\n[pretrain]\nrounds = 1\n'
                   '[personalize]\nrounds = 1\n')
    return cfg


def _damage(path, damage: str) -> None:
    """Rewrite a stage's tensor file with one damage (its metadata, the stage's stamp, kept:
    the content is what is damaged): an extra tensor, a missing one, an int or a NaN leaf."""
    import torch

    from partialfl import io as pio

    t, meta = pio.load_tensors(path, "tensors")
    first = sorted(t)[0]
    if damage == "extra":
        t["evil"] = torch.zeros(2)
    elif damage == "missing":
        del t[first]
    elif damage == "int":
        t[first] = t[first].to(torch.int32)
    else:
        t[first] = torch.full_like(t[first], float("nan"))
    pio.save_tensors(path, t, meta)


@pytest.mark.parametrize("damage", ["extra", "missing", "int", "nan"])
@pytest.mark.parametrize("stage_file", ["stage1/theta.safetensors", "theta_stage2.safetensors"])
def test_a_damaged_stage_file_is_refused_on_resume(tmp_path, capsys, damage, stage_file):
    """A resumed run read ``stage1/theta.safetensors`` / ``theta_stage2.safetensors`` as they
    were: an extra tensor was a KeyError traceback, a missing leaf of θ1 (or an empty file)
    silently started stage 2 from the fresh model's values, an integer θ1 was cast (stage 2
    from zeros), a float64 / int θ2 was a RuntimeError traceback, a NaN θ ran stage 3 and
    failed naming deploy.safetensors. Now the file must hold this run's names, shapes and
    dtypes, finite, or it is refused in one line naming it."""


    cfg, out = _tiny_train(tmp_path), tmp_path / "run"
    rc, err = _run(["train", cfg, "--out", out, "--no-progress"], capsys)
    assert rc == 0, err
    for name in ("report.md", "metrics.json", "deploy.safetensors"):  # an unfinished run
        (out / name).unlink()
    if stage_file.startswith("stage1"):
        (out / "theta_stage2.safetensors").unlink()
    path = out / stage_file
    _damage(path, damage)
    rc, err = _run(["train", cfg, "--out", out, "--no-progress"], capsys)
    assert rc == 2 and len(err) == 1 and stage_file in err[0], err
    assert "not written by this configuration" not in err[0]  # the content check refused it


def test_report_tensorboard_never_deletes_files_through_a_linked_folder(tmp_path, capsys):
    """``report RUN --tensorboard`` deleted ``events.out.tfevents.*`` in RUN/tensorboard and
    wrote new ones there: a received run whose ``tensorboard`` is a symbolic link to another
    folder had that folder's files deleted (exit 0). Now refused in one line."""
    pytest.importorskip("tensorboard")
    cfg, run = _tiny_train(tmp_path), tmp_path / "run"
    assert _run(["train", cfg, "--out", run, "--no-progress"], capsys)[0] == 0
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "events.out.tfevents.precious").write_text("x")
    (run / "tensorboard").symlink_to(victim)
    rc, err = _run(["report", run, "--tensorboard"], capsys)
    assert rc == 2 and len(err) == 1 and "symbolic link" in err[0], err
    assert [p.name for p in victim.iterdir()] == ["events.out.tfevents.precious"]


def test_secagg_on_one_supernode_is_refused_before_anything_starts():
    """``flower local --secagg --nodes 1`` started a SuperLink and a SuperNode and ran stage 1
    before the ServerApp refused SecAgg+ on one node. Now the pre-start check refuses it."""
    pytest.importorskip("flwr")
    from _flower_sims import ls_spec

    from partialfl.build import build
    from partialfl.config import ConfigError
    from partialfl.flower.train import check_flower_run
    from partialfl.spec import RunSpec

    run = build(RunSpec.from_dict(ls_spec(2)))
    with pytest.raises(ConfigError, match="at least 2 SuperNodes"):
        check_flower_run(run, {"secagg": True}, 1)


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="prctl: Linux")
def test_a_killed_flower_local_leaves_no_federation_process(tmp_path):
    """``kill -9`` of ``partialfl flower local`` left its SuperLink and SuperNodes (each in a
    session of its own) running for ever, and the ServerApp went on writing the run folder
    that a rerun uses. Now every process it starts gets SIGTERM when it dies."""
    import os
    import signal
    import subprocess
    import sys
    import time

    pytest.importorskip("flwr")
    parent = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\n"
        "from partialfl.flower.deployment import LocalFederation\n"
        f"fed = LocalFederation(1, simulation=True, work_dir={str(tmp_path)!r})\n"
        "p = fed._start('node', [sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(60)\n")], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        if open(f"/proc/{child}/stat").read().split(") ", 1)[1].startswith("Z"):
            break  # a zombie: it has exited
        time.sleep(0.05)
    else:
        os.kill(child, signal.SIGKILL)
        pytest.fail("the started process outlived its killed parent")


@pytest.mark.parametrize("damage", ["extra", "nan", "int"])
def test_a_damaged_client_state_file_is_refused_on_resume(tmp_path, capsys, damage):
    """FedAlt's ``client_state_stage2.client-side.safetensors`` (every client's w_m) was read
    unchecked on resume: NaN w_m were fine-tuned and evaluated (exit 0), an extra leaf was an
    IndexError traceback, an integer leaf a RuntimeError traceback. Now checked like a
    checkpoint's client state (``check_clients``): one line naming the file."""


    cfg, out = _tiny_train(tmp_path, "fedalt"), tmp_path / "run"
    assert _run(["train", cfg, "--out", out, "--no-progress"], capsys)[0] == 0
    for name in ("report.md", "metrics.json", "deploy.safetensors"):
        (out / name).unlink()
    path = out / "client_state_stage2.client-side.safetensors"
    _damage(path, damage)
    rc, err = _run(["train", cfg, "--out", out, "--no-progress"], capsys)
    assert rc == 2 and len(err) == 1 and path.name in err[0], err


def test_gldv2_csv_saved_with_a_byte_order_mark_reads(tmp_path, capsys):
    """A split CSV saved by a spreadsheet starts with a UTF-8 byte-order mark: its first
    column was read as '\\ufeffuser_id' and the file refused as missing ``user_id``."""
    csv, img = _gldv2(tmp_path, "u1,im0,0\r\nu1,im1,1\r\nu2,im2,0\r\n")
    csv.write_bytes(b"\xef\xbb\xbf" + csv.read_bytes())
    rc, err = _run(["data", "convert", "gldv2", csv, tmp_path / "s", "--images", img,
                    "--no-progress", "--option", "image_size=8"], capsys)
    assert rc == 0, err
