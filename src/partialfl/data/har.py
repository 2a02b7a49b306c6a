"""Human activity recognition by subject: UCI HAPT ("Smartphone-Based Recognition of Human
Activities and Postural Transitions", Reyes-Ortiz et al., CC BY 4.0) in its original
``RawData/`` layout (the shared copy and the UCI download read the same way).

API note::

    raw = load_hapt(data_dir=None)            # -> FederatedDataset, x float32 [n, 6, 128]
    raw.client_ids                           # subjects "03", "04", ...; y int64 in 0..5
    seen, new = raw.split_clients(5, seed=0)  # held-out subjects = new clients
    mean, std = channel_mean_std(seen)        # per-channel stats of the *training* windows
    seen, new = standardize(seen, mean, std), standardize(new, mean, std)

Files (``<root>`` is the folder holding ``RawData/``, or ``RawData`` itself):

* ``RawData/acc_expEE_userUU.txt`` / ``gyro_expEE_userUU.txt``: one sample per row at 50 Hz,
  three space-separated floats (accelerometer x y z in g; gyroscope x y z in rad/s) of
  experiment (session) EE of subject UU. Both files of a session must have the same rows.
* ``RawData/labels.txt``: ``experiment subject activity start end`` per row, 0-based sample
  indices into that session's files, both ends inclusive; samples outside every segment are
  unlabelled and never used.
* activities 1–6 are walking, upstairs, downstairs, sitting, standing, laying; 7–12 are the
  postural transitions (``activities="basic"`` keeps 1–6 as classes 0–5, ``"all"`` keeps 1–12
  as classes 0–11).

Windows: inside each labelled segment, windows of ``window`` samples starting every
``step = round(window · (1 − overlap))`` samples from the segment start, kept only if they end
inside the segment (a window never mixes two activities). A window is the ``[6, window]``
array (acc x y z, gyro x y z). Per subject, the windows of the *last* session (highest
experiment number) are the test set and those of the earlier session(s) the training set.

Bad input: a row that is not three finite numbers, a labels row that is not five integers,
a segment with start > end or outside its session's file, acc/gyro files of different
lengths, labels that name a subject/experiment pair without files — each raises
:class:`~partialfl.data.DataFormatError` naming the file and line. Documented skips (listed in
``meta["skipped"]`` with the reason): a subject with a single session (no session left to
test on), a subject with no labelled window in its training or test session(s), and signal
files without any label row.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from partialfl.data.federated import DataFormatError, FederatedDataset
from partialfl.data.paths import resolve_data_file
from partialfl.io import read_utf8

HAPT_DIR = "hapt"
ACTIVITY_SETS = {"basic": 6, "all": 12}
CHANNELS = ("acc_x", "acc_y", "acc_z", "gyro_x", "gyro_y", "gyro_z")
_FILE_RE = re.compile(r"^(acc|gyro)_exp(\d+)_user(\d+)\.txt$")


def _raw_dir(data_dir) -> Path:
    """The ``RawData`` folder: ``data_dir`` itself, ``data_dir/RawData`` or the shared
    ``<data>/hapt/RawData``."""
    if data_dir is not None:
        d = Path(data_dir)
        for cand in (d, d / "RawData", d / HAPT_DIR / "RawData"):
            if (cand / "labels.txt").exists():
                return cand
    root = resolve_data_file(HAPT_DIR, data_dir)
    raw = root / "RawData"
    if not (raw / "labels.txt").exists():
        raise DataFormatError(f"{raw} has no labels.txt: not the UCI HAPT RawData layout")
    return raw


def read_signal(path: Path) -> np.ndarray:
    """``[n, 3]`` float32 samples of one acc/gyro file; a clear error for a malformed row."""
    text = read_utf8(path)
    lines = text.splitlines()
    rows = [ln for ln in lines if ln.strip()]
    try:
        arr = np.array(text.split(), dtype=np.float64)
    except ValueError:
        arr = None
    if arr is None or arr.size != 3 * len(rows) or not np.isfinite(arr).all():
        for i, ln in enumerate(lines, 1):
            if not ln.strip():
                continue
            parts = ln.split()
            try:
                ok = len(parts) == 3 and all(np.isfinite(float(p)) for p in parts)
            except ValueError:
                ok = False
            if not ok:
                raise DataFormatError(f"{path}, line {i}: expected three finite numbers, got "
                                      f"{ln.strip()[:60]!r}")
        raise DataFormatError(f"{path}: could not parse the samples")  # pragma: no cover
    return arr.reshape(-1, 3).astype(np.float32)


def read_labels(path: Path) -> np.ndarray:
    """``[k, 5]`` int64 rows (experiment, subject, activity, start, end)."""
    out = []
    for i, ln in enumerate(read_utf8(path).splitlines(), 1):
        if not ln.strip():
            continue
        parts = ln.split()
        try:
            row = [int(p) for p in parts]
        except ValueError:
            row = []
        if len(row) != 5 or any(abs(v) >= 2 ** 62 for v in row):  # (int64: an overflow)
            raise DataFormatError(f"{path}, line {i}: expected five integers 'experiment "
                                  f"subject activity start end', got {ln.strip()[:60]!r}")
        if row[3] < 0 or row[3] > row[4]:
            raise DataFormatError(f"{path}, line {i}: segment start {row[3]} / end {row[4]} "
                                  "must satisfy 0 <= start <= end")
        out.append(row)
    if not out:
        raise DataFormatError(f"{path} has no label rows")
    return np.asarray(out, dtype=np.int64)


def window_starts(start: int, end: int, window: int, step: int) -> np.ndarray:
    """Start indices of the windows inside the inclusive segment [start, end]."""
    last = end - window + 1
    return np.arange(start, last + 1, step, dtype=np.int64) if last >= start else \
        np.zeros(0, np.int64)


def load_hapt(data_dir=None, *, window: int = 128, overlap: float = 0.5,
              activities: str = "basic", subjects=None) -> FederatedDataset:
    """The HAPT federation by subject (see the module docstring): raw (unstandardised)
    windows ``[n, 6, window]`` float32, labels int64; clients sorted by subject id.

    Args:
        data_dir: the data folder (holding ``hapt/RawData``), a HAPT root or ``RawData``.
        window: samples per window (>= 2). overlap: fraction in [0, 1) shared by consecutive
            windows. activities: ``"basic"`` (6 classes) or ``"all"`` (12).
        subjects: keep only these subject numbers (None: all with files).
    """
    if activities not in ACTIVITY_SETS:
        raise ValueError(f"activities must be one of {sorted(ACTIVITY_SETS)}, got {activities!r}")
    if not isinstance(window, int) or window < 2:
        raise ValueError(f"window must be an integer >= 2, got {window!r}")
    if not (isinstance(overlap, int | float) and 0.0 <= overlap < 1.0):
        raise ValueError(f"overlap must be in [0, 1), got {overlap!r}")
    step = max(1, int(round(window * (1.0 - overlap))))
    n_classes = ACTIVITY_SETS[activities]
    raw = _raw_dir(data_dir)
    files: dict[tuple[int, int], dict[str, Path]] = defaultdict(dict)
    for p in sorted(raw.iterdir()):
        m = _FILE_RE.match(p.name)
        if m:
            files[(int(m.group(2)), int(m.group(3)))][m.group(1)] = p
    if not files:
        raise DataFormatError(f"{raw} holds no acc_expEE_userUU.txt / gyro_... files")
    for fs in files.values():
        if len(fs) != 2:
            have = next(iter(fs.values())).name
            raise DataFormatError(f"{raw}: {have} has no matching "
                                  f"{'gyro' if 'acc' in fs else 'acc'} file")
    labels = read_labels(raw / "labels.txt")
    keep = None if subjects is None else {int(s) for s in subjects}
    segs: dict[tuple[int, int], list[tuple[int, int, int, int]]] = defaultdict(list)
    for line, (e, u, a, s, t) in enumerate(labels, 1):
        if (e, u) not in files:
            raise DataFormatError(f"{raw / 'labels.txt'}, line {line}: experiment {e} of "
                                  f"subject {u} has no acc/gyro files in {raw}")
        if 1 <= a <= n_classes and (keep is None or u in keep):
            segs[(e, u)].append((a - 1, s, t, line))
    skipped: dict[str, str] = {}
    by_subject: dict[int, list[int]] = defaultdict(list)
    for e, u in sorted(files):
        if keep is None or u in keep:
            by_subject[u].append(e)
    windows: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}
    for (e, u), fs in sorted(files.items()):
        if (keep is not None and u not in keep):
            continue
        acc, gyro = read_signal(fs["acc"]), read_signal(fs["gyro"])
        if acc.shape[0] != gyro.shape[0]:
            raise DataFormatError(f"{fs['acc'].name} has {acc.shape[0]} rows but "
                                  f"{fs['gyro'].name} has {gyro.shape[0]}; they must match")
        sig = np.concatenate([acc, gyro], axis=1).T  # [6, n]
        xs, ys = [], []
        for a, s, t, line in segs.get((e, u), []):
            if t >= sig.shape[1]:
                raise DataFormatError(
                    f"{raw / 'labels.txt'}, line {line}: segment [{s}, {t}] of experiment {e} "
                    f"lies outside {fs['acc'].name} ({sig.shape[1]} samples)")
            st = window_starts(s, t, window, step)
            if st.size:
                idx = st[:, None] + np.arange(window)[None, :]
                xs.append(sig[:, idx].transpose(1, 0, 2))
                ys.append(np.full(st.size, a, np.int64))
        if xs:
            windows[(e, u)] = (np.concatenate(xs), np.concatenate(ys))
        elif (e, u) not in segs:
            skipped[f"exp{e:02d}_user{u:02d}"] = "no label row of the chosen activities"
    empty = (np.zeros((0, 6, window), np.float32), np.zeros(0, np.int64))
    ids, tr_x, tr_y, te_x, te_y = [], [], [], [], []
    for u, exps in sorted(by_subject.items()):
        exps = sorted(exps)
        if len(exps) < 2:
            skipped[f"{u:02d}"] = "a single session: no later session to test on"
            continue
        train = [windows.get((e, u), empty) for e in exps[:-1]]
        test = windows.get((exps[-1], u), empty)
        trx, tr_lab = np.concatenate([w[0] for w in train]), np.concatenate([w[1] for w in train])
        if trx.shape[0] == 0 or test[0].shape[0] == 0:
            which = "training session(s)" if trx.shape[0] == 0 else "test session"
            skipped[f"{u:02d}"] = f"no labelled window of length {window} in its {which}"
            continue
        ids.append(f"{u:02d}")
        tr_x.append(torch.from_numpy(np.ascontiguousarray(trx)))
        tr_y.append(torch.from_numpy(tr_lab))
        te_x.append(torch.from_numpy(np.ascontiguousarray(test[0])))
        te_y.append(torch.from_numpy(test[1]))
    if not ids:
        raise DataFormatError(f"no subject in {raw} has labelled windows in a training and a "
                              f"test session (skipped: {skipped})")
    return FederatedDataset(
        tr_x, tr_y, te_x, te_y, ids, n_classes,
        description=(f"UCI HAPT by subject, {activities} activities, windows {window} "
                     f"(step {step}), train = first session(s), test = last"),
        meta={"window": window, "step": step, "activities": activities,
              "channels": list(CHANNELS), "skipped": skipped, "source": str(raw)})


def channel_mean_std(data: FederatedDataset) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel mean and std ``[C]`` over every training window of ``data`` (call it on the
    training subjects only)."""
    x = torch.cat(list(data.train_x)).double()
    if x.shape[0] == 0:
        raise ValueError("no training window to compute channel statistics from")
    flat = x.transpose(0, 1).reshape(x.shape[1], -1)
    std = flat.std(dim=1, unbiased=False)
    return flat.mean(dim=1).float().numpy(), torch.clamp(std, min=1e-6).float().numpy()


def standardize(data: FederatedDataset, mean, std) -> FederatedDataset:
    """``(x − mean_c) / std_c`` per channel c, for every window of every client."""
    m = torch.as_tensor(np.asarray(mean, np.float32)).reshape(1, -1, 1)
    s = torch.as_tensor(np.asarray(std, np.float32)).reshape(1, -1, 1)
    if not (torch.isfinite(m).all() and torch.isfinite(s).all() and (s > 0).all()):
        raise ValueError("channel mean/std must be finite with std > 0")

    def f(xs):
        return tuple((x - m) / s for x in xs)

    return FederatedDataset(f(data.train_x), data.train_y, f(data.test_x), data.test_y,
                            data.client_ids, data.num_classes, data.description,
                            {**data.meta, "channel_mean": np.asarray(mean).tolist(),
                             "channel_std": np.asarray(std).tolist()})
