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
