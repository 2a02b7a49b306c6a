"""``--overwrite`` deletes what the finished run wrote and nothing else
(:mod:`partialfl.pipeline.run_files`)."""

from __future__ import annotations

import json

import pytest

from partialfl.pipeline.run_files import record_end, record_start, remove_run
from partialfl.pipeline.train import claim_out


def _finished_run(out, user=("my.toml", "notes.txt")):
    out.mkdir()
    for name in user:
        (out / name).write_text("mine\n")
    record_start(out)
    (out / "spec.json").write_text("{}")
    (out / "stage1").mkdir()
    (out / "stage1" / "theta.safetensors").write_text("x")
    (out / "report.md").write_text("# run\n")
    record_end(out)


def test_overwrite_keeps_the_users_files_before_and_after_the_run(tmp_path):
    out = tmp_path / "run"
    _finished_run(out)
    (out / "later.txt").write_text("added after the run\n")
    with pytest.raises(FileExistsError, match="--overwrite"):
        claim_out(out)  # without --overwrite: refused
    claim_out(out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["later.txt", "my.toml", "notes.txt"]


def test_a_resumed_run_still_knows_the_users_files(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("mine\n")
    record_start(out)
    (out / "spec.json").write_text("{}")  # killed here, then resumed:
    record_start(out)  # the second start must not count spec.json as the user's
    (out / "report.md").write_text("# run\n")
    record_end(out)
    remove_run(out)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


@pytest.mark.parametrize("record", [None, "not json", json.dumps({"names": ["../outside"]}),
                                    json.dumps({"names": "report.md"}), json.dumps([1])])
def test_without_a_sound_record_overwrite_refuses_and_deletes_nothing(tmp_path, record):
    outside = tmp_path / "outside"
    outside.write_text("keep\n")
    out = tmp_path / "run"
    _finished_run(out)
    (out / "run_files.json").unlink()
    (out / "preexisting.json").unlink()  # neither record (an older run)
    (out / "spec.json").write_text("{}")
    if record is not None:
        (out / "run_files.json").write_text(record)
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(FileExistsError, match="record of the files it wrote"):
        claim_out(out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == before and outside.is_file()


def test_a_symlink_the_run_lists_is_removed_as_a_link(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep.txt").write_text("keep\n")
    out = tmp_path / "run"
    out.mkdir()
    record_start(out)
    (out / "spec.json").write_text("{}")
    (out / "report.md").write_text("# run\n")
    (out / "link").symlink_to(target, target_is_directory=True)
    record_end(out)
    remove_run(out)
    assert list(out.iterdir()) == [] and (target / "keep.txt").is_file()


def test_a_run_killed_before_its_last_record_is_removed_by_the_first(tmp_path):
    """Killed between report.md and run_files.json: what is not in preexisting.json is the
    run's."""
    out = tmp_path / "run"
    _finished_run(out)
    (out / "run_files.json").unlink()
    claim_out(out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["my.toml", "notes.txt"]


@pytest.mark.parametrize("killed_after", range(6))
def test_a_kill_at_any_point_of_the_removal_leaves_a_run_overwrite_finishes(tmp_path,
                                                                           monkeypatch,
                                                                           killed_after):
    """A kill after any deletion of :func:`remove_run` leaves a folder that still counts as a
    finished run, and the next ``--overwrite`` removes the rest (the user's files stay)."""
    import os

    from partialfl.pipeline import run_files
    from partialfl.pipeline.train import finished

    out = tmp_path / "run"
    _finished_run(out)
    (out / "stage2.ckpt").write_text("x")
    record_end(out)
    done = []

    class Killed(BaseException):
        pass

    real_unlink, real_rmtree = os.unlink, run_files.shutil.rmtree

    def count(fn):
        def wrapped(*a, **k):
            if len(done) == killed_after:
                raise Killed
            done.append(a[0])
            return fn(*a, **k)
        return wrapped

    monkeypatch.setattr(run_files.Path, "unlink", count(lambda p, **k: real_unlink(p)))
    monkeypatch.setattr(run_files.shutil, "rmtree", count(real_rmtree))
    try:
        remove_run(out)
    except Killed:
        assert finished(out)  # still a finished run: refused without --overwrite
    monkeypatch.undo()
    if finished(out):
        claim_out(out, overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == ["my.toml", "notes.txt"]


def test_a_linked_folder_anywhere_below_the_run_folder_is_refused(tmp_path):
    from partialfl.pipeline.run_files import refuse_linked_folders

    out, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    (out / "personalized").mkdir(parents=True)
    elsewhere.mkdir()
    refuse_linked_folders(out)  # real folders only: fine
    (out / "personalized" / "clients").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(FileExistsError, match="symbolic link"):
        refuse_linked_folders(out)


def test_a_removal_cut_short_is_refused_by_a_study_without_overwrite(tmp_path):
    from partialfl.pipeline.train import removal_cut_short

    out = tmp_path / "run"
    _finished_run(out)
    (out / "spec.json").unlink()  # what remove_run deletes first
    assert removal_cut_short(out)
    with pytest.raises(FileExistsError, match="--overwrite"):
        claim_out(out)


def test_a_users_file_named_like_one_the_run_writes_refuses_the_start(tmp_path):
    """A user's ``report.md`` (or ``learning_curves.png``, ``tensorboard/``) in ``--out`` was
    recorded as the user's and then written over by the run (its own report); the start is
    refused in one line now, the file kept."""

    out = tmp_path / "exp"
    out.mkdir()
    (out / "report.md").write_text("my own report\n")
    cfg = tmp_path / "a.toml"
    cfg.write_text('name = "a"\n[problem]\nkind = "least_squares"\n')
    with pytest.raises(FileExistsError, match="report.md is not a run's"):
        record_start(out, "a")
    (out / "report.md").rename(out / "a.jsonl")  # named after the spec
    with pytest.raises(FileExistsError, match="a.jsonl"):
        record_start(out, "a")
    record_start(out, "b")  # another spec's name: the user's file
    assert json.loads((out / "preexisting.json").read_text())["names"] == ["a.jsonl"]


def test_every_name_a_finished_run_writes_is_a_run_name(tmp_path, user_module, capsys):
    """:data:`~partialfl.pipeline.run_files.RUN_NAMES` (what a start refuses from the user)
    names every entry of a run, of its report's TensorBoard scalars and of ``compare``;
    those later entries are listed in ``run_files.json``, so ``--overwrite`` deletes them."""
    import fnmatch

    from _user_project import client_folder, tiny_toml

    from partialfl.cli import main
    from partialfl.pipeline.run_files import run_names

    cfg = tiny_toml(tmp_path / "t.toml", user_module, client_folder(tmp_path / "clients"),
                    name="my.run")
    out = tmp_path / "o"
    assert main(["train", str(cfg), "--out", str(out), "--no-progress"]) == 0
    assert main(["report", str(out), "--tensorboard"]) == 0
    assert main(["compare", str(out)]) == 0
    names = sorted(p.name for p in out.iterdir())
    assert {"tensorboard", "compare.md", "stage2.jsonl"} <= set(names)
    stray = [n for n in names if n not in ("preexisting.json", "run_files.json")
             and not any(fnmatch.fnmatchcase(n, p) for p in run_names("my.run"))]
    assert not stray, f"entries of a run that RUN_NAMES does not name: {stray}"
    listed = json.loads((out / "run_files.json").read_text())["names"]
    assert {"tensorboard", "compare.md", "compare.png"} <= set(listed)
    assert main(["train", str(cfg), "--out", str(out), "--no-progress", "--overwrite"]) == 0
    assert json.loads((out / "preexisting.json").read_text())["names"] == []
