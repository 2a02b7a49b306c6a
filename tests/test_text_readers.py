"""Received text files are read as what they are (adversarial round 12's open items): the
tiny Shakespeare file given as a folder or FIFO was said not to exist, and text in another
encoding in a HAPT folder or a complete-works play gave an error naming no file. Now each
is one line naming the file (:func:`partialfl.io.read_utf8`)."""

from __future__ import annotations

import os

import pytest

from partialfl.data.har import read_labels, read_signal
from partialfl.data.shakespeare import ShakespeareFormatError, load_shakespeare
from partialfl.data.shakespeare_complete import complete_roles
from partialfl.io import FileFormatError

LATIN1 = "Ça, mon seigneur".encode("latin-1")


@pytest.mark.parametrize("kind", ["folder", "fifo"])
def test_the_tiny_shakespeare_file_as_a_folder_or_fifo_is_named_as_such(tmp_path, kind):
    f = tmp_path / "shakespeare.txt"
    f.mkdir() if kind == "folder" else os.mkfifo(f)
    with pytest.raises(ShakespeareFormatError) as e:
        load_shakespeare(path=f)
    assert "does not exist" not in str(e.value) and str(f) in str(e.value)


def test_the_tiny_shakespeare_file_in_latin1_is_named(tmp_path):
    f = tmp_path / "shakespeare.txt"
    f.write_bytes(LATIN1)
    with pytest.raises(ShakespeareFormatError, match=r"shakespeare.txt is not UTF-8 text"):
        load_shakespeare(path=f)


@pytest.mark.parametrize("read", [read_signal, read_labels])
def test_a_hapt_file_in_another_encoding_is_named(tmp_path, read):
    f = tmp_path / "acc_exp01_user01.txt"
    f.write_bytes(b"0.1 0.2 0.3\n" + LATIN1)
    with pytest.raises(FileFormatError, match=r"acc_exp01_user01.txt is not UTF-8 text \(byte"):
        read(f)


def test_a_play_in_another_encoding_is_named(tmp_path):
    (tmp_path / "hamlet.md").write_bytes(LATIN1)
    with pytest.raises(FileFormatError, match=r"hamlet.md is not UTF-8 text"):
        complete_roles(tmp_path)
