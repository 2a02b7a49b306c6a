"""The one table driver: every jointly personalized row gets its matched baseline, FedAvg +
fine-tuning of the same part, and shares FedAvg's stage 2 (issue 22)."""

from __future__ import annotations

import pytest

from partialfl.reproductions.femnist import FEMNIST
from partialfl.reproductions.har import HAR
from partialfl.reproductions.matched import matched_method, part_name, with_matched
from partialfl.reproductions.shakespeare import SHAKESPEARE
from partialfl.spec import MethodConfig

TABLES = (FEMNIST, HAR, SHAKESPEARE)
JOINT = ("FFGG", "Local FFGG", "FedAlt", "FedSim")


@pytest.mark.parametrize("table", TABLES, ids=lambda t: t.name)
def test_every_jointly_personalized_row_has_its_matched_row(table):
    rows = dict(table.rows)
    joint = [label for label in rows if label.startswith(JOINT)]
    assert joint and "FedAvg" in rows
    matched = table.matched(list(rows))
    assert sorted(matched) == sorted(joint)
    for label in joint:
        base = rows[matched[label]]
        # the same part, fine-tuned after FedAvg: same split (options included)
        assert base.algorithm == "fedavg" and base.finetune_split == rows[label].split
        assert matched[label] == f"FedAvg + FT ({rows[label].split.name})"
    assert rows["FedAvg"].finetune_split is None  # plain FedAvg stays a row
    # FedAvg and its fine-tuned variants are one job: one stage 2 per seed
    size = table.QUICK
    group = next(g for g in table.groups(size) if "FedAvg" in g)
    assert sorted(group) == sorted(["FedAvg", *set(matched.values())])
    assert all(len(g) == 1 for g in table.groups(size) if "FedAvg" not in g)


def test_matched_rows_follow_fedavg_once_per_part_with_their_options():
    rows = (("FedAvg", MethodConfig(algorithm="fedavg")),
            ("FFGG (a4)", MethodConfig(algorithm="ffgg",
                                       split={"name": "adapter", "rank": 4})),
            ("FedAlt (output)", MethodConfig(algorithm="fedalt", split="output")),
            ("FedSim (output)", MethodConfig(algorithm="fedsim", split="output")),
            ("Ditto", MethodConfig(algorithm="ditto", options={"lam": 0.1})))
    out = with_matched(rows)
    assert [label for label, _ in out] == ["FedAvg", "FedAvg + FT (adapter, rank=4)",
                                            "FedAvg + FT (output)", "FFGG (a4)",
                                            "FedAlt (output)", "FedSim (output)", "Ditto"]
    m = dict(out)["FedAvg + FT (adapter, rank=4)"]
    assert m.finetune_split.options.rank == 4 and m.name == "fedavg-ft-adapter-rank4"
    assert part_name(rows[2][1]) == "output"
    for _, method in rows[:1] + rows[-1:]:  # shared or fully personal: no matched row
        assert matched_method(method) is None


# ----------------------------------------------------------------------------- heterogeneity
def _har_like(clients=3, n=4):
    import torch

    from partialfl.data.federated import FederatedDataset

    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(n, 6, 16, generator=g) for _ in range(clients)]
    ys = [torch.randint(0, 5, (n,), generator=g) for _ in range(clients)]
    return FederatedDataset(xs, ys, xs, ys, [f"s{m}" for m in range(clients)], 5)


def test_sensor_transform_rotates_each_subjects_axes_and_scales_them():
    import numpy as np
    import torch

    from partialfl.reproductions.heterogeneity import rotate_sensors

    data = _har_like()
    same = rotate_sensors(data, 0.0)
    assert all(torch.allclose(a, b) for a, b in zip(same.train_x, data.train_x))
    out = rotate_sensors(data, 1.0)
    for m in range(data.num_clients):
        x, y = data.train_x[m], out.train_x[m]
        # one matrix g·R per subject on both triplets: recover it from the accelerometer and
        # check it is a scaled rotation that also maps the gyroscope
        xa, ya = x[:, :3].transpose(0, 1).reshape(3, -1), y[:, :3].transpose(0, 1).reshape(3, -1)
        mat = ya @ torch.linalg.pinv(xa)
        gain = torch.linalg.det(mat).abs() ** (1 / 3)
        rot = (mat / gain).double()
        assert torch.allclose(rot @ rot.T, torch.eye(3, dtype=torch.float64), atol=1e-4)
        assert 0.5 - 1e-4 <= gain <= 2.0 + 1e-4 and not torch.allclose(rot, torch.eye(3).double())
        assert torch.allclose(y[:, 3:], torch.einsum("ij,njt->nit", mat, x[:, 3:]), atol=1e-4)
        assert torch.equal(out.test_x[m], y)  # the subject's test windows alike
    assert not np.allclose(*(rotate_sensors(data, 1.0).train_x[m][0, 0].numpy() for m in (0, 1)))


def test_label_permutation_relabels_a_fraction_of_classes_per_writer():
    import torch

    from partialfl.reproductions.heterogeneity import permute_labels

    data = _har_like(clients=4, n=200)
    assert all(torch.equal(a, b) for a, b in zip(permute_labels(data, 0.0).train_y,
                                                  data.train_y))
    for s, k in ((0.4, 2), (1.0, 5)):
        out = permute_labels(data, s)
        for m in range(4):
            old, new = data.train_y[m], out.train_y[m]
            moved = {int(c) for c in old.unique() if (new[old == c] != c).any()}
            assert len(moved) == k  # round(s·C) classes change, each to another one
            mapping = {int(a): int(b) for a, b in zip(old, new)}
            assert len(set(mapping.values())) == len(mapping)  # a bijection
            assert torch.equal(out.test_y[m], new)  # the writer's test labels alike


def test_least_squares_map_has_no_gap_without_heterogeneity_and_the_predicted_one_with():
    import numpy as np

    from partialfl.reproductions.heterogeneity import LSSize, least_squares_map

    size = LSSize(num_clients=10, n=80, n_test=4000, d_theta=6, d_w=2, noise=0.0, seeds=(0,))
    out = least_squares_map(size, strengths=(0.0, 1.0))
    # a shared w is the true model at s = 0: both limits are θ₀, identical test losses
    assert np.allclose(out[0.0]["ffgg"], out[0.0]["ft"], atol=1e-12)
    assert abs(out[0.0]["predicted"]) < 1e-12
    # at s = 1 FedAvg's θ is off; the measured gap is the predicted expectation
    gap = float((out[1.0]["ft"] - out[1.0]["ffgg"]).mean())
    assert gap > 0 and gap == pytest.approx(out[1.0]["predicted"], rel=0.15)


@pytest.mark.slow
@pytest.mark.data
def test_heterogeneity_quick_writes_summary_and_gap_plot(tmp_path, data_dir):
    import json

    from partialfl.registry import entry
    from partialfl.reproductions.heterogeneity import QUICK_STRENGTHS, reproduce_heterogeneity

    assert entry("reproduction", "heterogeneity").build is reproduce_heterogeneity
    path = reproduce_heterogeneity(tmp_path, quick=True, data_dir=data_dir, progress=False)
    text = path.read_text()
    from _summaries import check_standalone_summary

    check_standalone_summary(text, quick=True)
    for title in ("HAR by subject", "FEMNIST by writer", "least squares"):
        assert f"## {title}" in text
    assert "FFGG (input)" in text and "FedAvg + FT (output)" in text
    assert (tmp_path / "gap.png").stat().st_size > 10_000
    record = json.loads((tmp_path / "map.json").read_text())
    for key in ("har", "femnist"):
        rows = record["panels"][key]["rows"]
        assert [r["s"] for r in rows] == list(QUICK_STRENGTHS)
        assert all(r["low"] <= r["estimate"] <= r["high"] for r in rows)
