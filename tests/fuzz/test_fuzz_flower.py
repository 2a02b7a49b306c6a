"""Fuzzing what a SuperNode can send the ServerApp (issue 21): random train replies (wrong
leaf names, shapes and dtypes, NaN/±inf, huge or negative weights, wrong cohorts, missing,
extra and mistyped records, metrics as lists, strings or the wrong record kind, string and
pickled object arrays, undecodable bytes), evaluation and describe replies, and crafted
ServerApp checkpoints (the pointer's and the server file's metadata).

The oracle is independent of the codec: every reply is built from per-part choices whose
validity is known. A valid reply must decode to exactly what was sent; any other must be
counted as a failure of its node (:func:`partialfl.flower.rounds.decode_reply`: a
``Failure`` of kind ``invalid`` in the report, k lost client computations in the fault log)
with a one-line reason from an explicit check — never another exception. No Ray, no
processes: the decoders are called directly (about 10 s for the whole module).
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass

import numpy as np
import pytest

pytest.importorskip("flwr", reason="flwr is not installed (pip install 'partialfl[flower]')")
hypothesis = pytest.importorskip("hypothesis", reason="pip install hypothesis")

from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from partialfl.flower.codec import (  # noqa: E402
    EVAL_KEYS,
    WireFormatError,
    decode_describe,
    decode_eval,
    decode_updates,
)

SETTINGS = settings(max_examples=300, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])
THETA = {"a": np.zeros((2, 3), np.float32), "b": np.zeros(4, np.float32)}
SAFETY_NET = "malformed "  # the prefix of a reason no explicit check produced


def _one_line_reason(err: Exception) -> str:
    text = str(err)
    assert isinstance(err, WireFormatError), f"{type(err).__name__}: {text}"
    assert text and "\n" not in text and len(text) < 700, text
    assert not text.startswith(SAFETY_NET), f"no explicit check caught it: {text}"
    return text


# -- train replies ------------------------------------------------------------------------------
TREE_KINDS = ["ok"] * 12 + ["missing-leaf", "extra-leaf", "shape", "dtype", "nan", "inf",
              "string", "object", "garbage", "int", "config-record"]


def _pickled_object_array(shape) -> Array:
    buf = io.BytesIO()
    np.save(buf, np.empty(shape, dtype=object), allow_pickle=True)
    return Array(dtype="object", shape=tuple(shape), stype="numpy.ndarray", data=buf.getvalue())


#: most parts are drawn valid, so that a good share of the replies are valid as a whole
def _tree(kind: str, k: int, rng: np.random.Generator):
    """``(record, valid, values)`` of a stacked θ-tree of the given corruption kind."""
    vals = {n: rng.standard_normal((k, *v.shape)).astype(np.float32) for n, v in THETA.items()}
    if kind == "config-record":
        return ConfigRecord({"a": "x"}), False, None
    arrays = {n: Array(v) for n, v in vals.items()}
    bad = "a" if rng.random() < 0.5 else "b"
    if kind == "missing-leaf":
        arrays.pop(bad)
    elif kind == "extra-leaf":
        arrays["w_personal"] = Array(np.zeros((k, 2), np.float32))
    elif kind == "shape":
        arrays[bad] = Array(np.zeros((k + 1, *THETA[bad].shape), np.float32))
    elif kind == "dtype":
        arrays[bad] = Array(vals[bad].astype(np.float64))
    elif kind in ("nan", "inf"):
        v = vals[bad].copy()
        v.flat[int(rng.integers(v.size))] = np.nan if kind == "nan" else -np.inf
        arrays[bad] = Array(v)
    elif kind == "string":
        arrays[bad] = Array(np.full(vals[bad].shape, "w"))
    elif kind == "object":
        arrays[bad] = _pickled_object_array(vals[bad].shape)
    elif kind == "garbage":
        arrays[bad] = Array(dtype="float32", shape=vals[bad].shape, stype="numpy.ndarray",
                            data=rng.bytes(int(rng.integers(0, 40))))
    elif kind == "int":
        arrays[bad] = Array(np.zeros(vals[bad].shape, np.int32))
    return ArrayRecord(arrays), kind == "ok", vals


class _Declares:
    def __init__(self, names) -> None:
        self.extra_names = tuple(names)


@dataclass
class Reply:
    content: RecordDict
    valid: bool
    asked: np.ndarray
    bound: np.ndarray
    declared: tuple[str, ...]
    vectors: dict | None
    weights: list | None
    metrics: dict


WEIGHT_KINDS = ["ok"] * 12 + ["at-bound", "negative", "above", "1e39", "nan", "inf",
                "string", "bool", "length", "huge-int", "not-a-list"]
COHORT_KINDS = ["ok"] * 12 + ["other", "length", "strings", "bools", "order"]
GRAD_KINDS = ["ok"] * 12 + ["negative", "string", "fraction", "bool", "huge"]
UPDATE_KINDS = ["ok"] * 12 + ["missing-key", "extra-key", "metric-record", "absent"]
METRIC_KINDS = ["absent"] * 6 + ["ok"] * 6 + ["count-above-k", "list", "unlisted", "string-config",
                "sum-only", "nan", "object-array"]
EXTRA_SETS = [(), (), ("dc",), ("dc",), ("aux",), ("dc", "aux")]
JUNK_KINDS = ["none"] * 12 + ["config", "array"]


@st.composite
def train_replies(draw) -> Reply:
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 32 - 1)))
    k = draw(st.integers(1, 3))
    asked = np.sort(rng.choice(50, k, replace=False)).astype(np.int64)
    bound = np.asarray(draw(st.lists(st.sampled_from([1.0, 7.0, 300.0]), min_size=k,
                                     max_size=k)))
    valid = True
    content = RecordDict()
    # vectors
    vkind = draw(st.sampled_from([*TREE_KINDS, "absent"]))
    vectors = None
    if vkind != "absent":
        content["vectors"], ok, vectors = _tree(vkind, k, rng)
        valid &= ok
    else:
        valid = False
    # update: cohort, weights, grad-evals
    ckind = draw(st.sampled_from(COHORT_KINDS))
    cohort = {"ok": asked.tolist(), "other": (asked + 1).tolist(),
              "length": asked.tolist() + [99], "strings": [str(c) for c in asked],
              "bools": [True] * k, "order": asked[::-1].tolist()}[ckind]
    valid &= ckind == "ok" or (ckind == "order" and k == 1)
    wkind = draw(st.sampled_from(WEIGHT_KINDS))
    ok_w = [float(b * rng.random()) for b in bound]
    weights = {"ok": ok_w, "at-bound": [float(b) for b in bound],
               "negative": [-1.0] + ok_w[1:], "above": [float(bound[0]) * 1.5] + ok_w[1:],
               "1e39": [1e39] * k, "nan": [float("nan")] + ok_w[1:],
               "inf": ok_w[:-1] + [float("inf")], "string": ["1"] * k, "bool": [True] * k,
               "length": ok_w + [1.0], "huge-int": [10 ** 400] * k, "not-a-list": 1.0}[wkind]
    valid &= wkind in ("ok", "at-bound")
    gkind = draw(st.sampled_from(GRAD_KINDS))
    grads = {"ok": int(rng.integers(0, 100)), "negative": -3, "string": "3", "fraction": 2.5,
             "bool": True, "huge": 2 ** 60}[gkind]
    valid &= gkind == "ok"
    ukind = draw(st.sampled_from(UPDATE_KINDS))
    update = {"cohort": cohort, "weights": weights, "grad-evals": grads}
    if ukind == "missing-key":
        update.pop(draw(st.sampled_from(sorted(update))))
    elif ukind == "extra-key":
        update["w"] = [0.5] * k
    if ukind == "metric-record":
        content["update"] = MetricRecord({"grad-evals": 1})
    elif ukind != "absent":
        content["update"] = ConfigRecord(update)
    valid &= ukind == "ok"
    # metrics (sums and counts over the node's clients)
    mkind = draw(st.sampled_from(METRIC_KINDS))
    loss = float(rng.random() * k)
    metrics = {}
    if mkind == "ok":
        content["metrics"] = MetricRecord({"loss.sum": loss, "loss.count": k})
        metrics = {"loss": (loss, float(k))}
    elif mkind == "count-above-k":
        content["metrics"] = MetricRecord({"loss.sum": loss, "loss.count": k + 1})
    elif mkind == "list":
        content["metrics"] = MetricRecord({"loss.sum": [loss] * k, "loss.count": k})
    elif mkind == "unlisted":
        content["metrics"] = MetricRecord({"w.sum": loss, "w.count": k})
    elif mkind == "string-config":
        content["metrics"] = ConfigRecord({"loss.sum": "0.1 0.2", "loss.count": k})
    elif mkind == "sum-only":
        content["metrics"] = MetricRecord({"train_loss.sum": loss})
    elif mkind == "nan":
        content["metrics"] = MetricRecord({"loss.sum": float("nan"), "loss.count": k})
    elif mkind == "object-array":
        content["metrics"] = ArrayRecord({"loss": _pickled_object_array((k,))})
    valid &= mkind in ("absent", "ok")
    # extras: the algorithm declares some; the node sends some
    declared = draw(st.sampled_from(EXTRA_SETS[:4]))
    sent = draw(st.sampled_from(EXTRA_SETS))
    for name in sent:
        content[f"extra.{name}"], ok, _ = _tree(draw(st.sampled_from(TREE_KINDS)), k, rng)
        valid &= ok
    valid &= set(sent) == set(declared)
    jkind = draw(st.sampled_from(JUNK_KINDS))
    if jkind == "config":
        content["note"] = ConfigRecord({"text": "hello"})
    elif jkind == "array":
        content["w"] = ArrayRecord({"w": Array(np.zeros(3, np.float32))})
    valid &= jkind == "none"
    return Reply(content, bool(valid), asked, bound, declared, vectors,
                 weights if isinstance(weights, list) else None, metrics)


class _Msg:
    """A reply as :func:`decode_reply` sees it (a real Message needs a Flower run)."""

    def __init__(self, content) -> None:
        self.content = content

    def has_error(self) -> bool:
        return False


def _federation(bound: np.ndarray, asked: np.ndarray, torch: bool):
    from partialfl.flower.federation import Federation

    examples = np.zeros(50)
    examples[asked] = bound  # max(1, n_m) = bound
    theta = {n: _torch(v) for n, v in THETA.items()} if torch else THETA
    return Federation({7: {"partition-id": 3, "clients": list(range(50))}}, [7],
                      np.zeros(50, np.int64), 50, theta, torch, examples)


def _torch(v):
    import torch

    return torch.from_numpy(np.asarray(v))


@SETTINGS
@given(reply=train_replies(), use_torch=st.booleans())
def test_train_replies_are_accepted_exactly_when_valid_else_counted(reply, use_torch):
    from partialfl.flower.report import FlowerRunReport
    from partialfl.flower.rounds import decode_reply
    from partialfl.runtime.faults import FaultLog

    hypothesis.event("valid" if reply.valid else "invalid")
    fed = _federation(reply.bound, reply.asked, use_torch)
    theta = fed.theta0
    report, faults = FlowerRunReport({}, theta), FaultLog()
    alg = _Declares(reply.declared)
    got = decode_reply(_Msg(reply.content), theta, reply.asked, fed, 7, 4, report, alg, faults)
    if reply.valid:
        assert got is not None and not report.failures
        up, metrics = got
        for n, v in reply.vectors.items():
            out = up.vectors[n].numpy() if use_torch else up.vectors[n]
            np.testing.assert_array_equal(out, v)
        np.testing.assert_array_equal(up.weights, reply.weights)
        np.testing.assert_array_equal(up.cohort, reply.asked)
        assert metrics == reply.metrics and set(up.extra) == set(reply.declared)
        return
    assert got is None, "an invalid reply was accepted"
    (f,) = report.failures
    assert (f.kind, f.partition, f.round, f.clients) == ("invalid", 3, 4, reply.asked.tolist())
    assert faults.failed == len(reply.asked) == faults.attempted
    with pytest.raises(Exception) as e:  # the decoder itself: WireFormatError, one line
        decode_updates(reply.content, theta, reply.asked, use_torch,
                       max_weights=reply.bound, algorithm=alg)
    assert _one_line_reason(e.value) in f.reason or f.reason.startswith(str(e.value)[:200])


# -- evaluation and describe replies -------------------------------------------------------------
def _eval_base(kind: str, n: int) -> dict:
    if kind == "least-squares":
        return {"clients": float(n), "loss.sum": 3.5, "loss-gap.sum": 0.5}
    return {"clients": float(n), "correct.sum": 30.0, "total.sum": 40.0, "loss_sum.sum": 9.0,
            "loss_weight.sum": 40.0, "acc.count": float(n)}


EVAL_CORRUPTIONS = [None, None, "drop", "add", "list", "nan", "fraction-count", "negative",
                    "too-few", "too-many", "hist", "bool-int", "wrong-record", "extra-record",
                    "withheld", "overweight"]


@SETTINGS
@given(kind=st.sampled_from(sorted(EVAL_KEYS)), n=st.integers(1, 6),
       min_clients=st.integers(1, 4), corruption=st.sampled_from(EVAL_CORRUPTIONS),
       pick=st.integers(0, 6))
def test_evaluation_replies_are_sums_over_enough_clients_or_refused(kind, n, min_clients,
                                                                    corruption, pick):
    rec = _eval_base(kind, n)
    key = sorted(rec)[pick % len(rec)]
    valid = n >= min_clients
    content = RecordDict()
    if corruption == "drop":
        rec.pop(key)
    elif corruption == "add":
        rec["loss_per_client.sum"] = 1.0
    elif corruption == "list":
        rec[key] = [rec[key]] * 2
    elif corruption == "nan":
        rec[key] = float("nan")
    elif corruption == "fraction-count":
        rec["clients"] = n - 0.5
    elif corruption == "negative":
        rec["clients"] = -1.0
    elif corruption == "too-few":  # sums over fewer clients than eval-min-clients
        valid = False
        rec["clients"] = float(min_clients - 1)
        if "acc.count" in rec:
            rec["acc.count"] = float(min_clients - 1)
    elif corruption == "too-many":
        rec["clients"] = float(n + 1)
    elif corruption == "hist":
        rec["acc.hist"] = [0.0] * 1000
    elif corruption == "overweight" and kind == "model":  # beyond the declared eval-units
        rec["loss_weight.sum"] = rec["loss_sum.sum"] = 1.7e308
    elif corruption == "overweight":
        corruption = None  # least squares weighs nothing
    elif corruption == "bool-int":  # a ConfigRecord may carry bools and strings
        content["eval"] = ConfigRecord({**rec, "clients": True})
    if corruption == "wrong-record":
        content["eval"] = ArrayRecord({"x": Array(np.zeros(2))})
    elif corruption != "bool-int":
        content["eval"] = MetricRecord({} if corruption == "withheld" else rec)
    if corruption == "extra-record":
        content["theta"] = ArrayRecord({"x": Array(np.zeros(2))})
    valid = corruption == "withheld" or (valid and corruption is None)
    hypothesis.event("valid" if valid else "invalid")
    try:
        got = decode_eval(content, kind=kind, min_clients=min_clients, max_clients=n,
                          max_units=(40.0, 40.0))
    except Exception as e:  # noqa: BLE001 - checked to be the one-line WireFormatError
        assert not valid, f"valid reply refused: {e}"
        _one_line_reason(e)
        return
    assert valid, f"invalid evaluation accepted: {corruption} {rec}"
    if corruption == "withheld":
        assert got is None
        return
    assert got == rec


DESCRIBE_CORRUPTIONS = [None, None, "clients", "partition", "examples-nan", "examples-huge",
                        "examples-negative", "units-huge", "units-short", "num-clients",
                        "torch", "missing", "extra", "strings", "record-kind", "theta0-junk"]


@SETTINGS
@given(nparts=st.integers(1, 4), M=st.integers(4, 20), part=st.integers(0, 3),
       corruption=st.sampled_from(DESCRIBE_CORRUPTIONS))
def test_describe_replies_are_checked(nparts, M, part, corruption):
    from partialfl.flower.config import partition_clients

    part = part % nparts
    clients = partition_clients(M, nparts, part).tolist()
    info = {"partition-id": part, "num-partitions": nparts, "num-clients": M,
            "clients": clients, "num-examples": [5.0] * len(clients),
            "eval-units": [5.0 * len(clients)] * 2, "torch": 0}
    if corruption == "clients":
        info["clients"] = [(c + 1) % M for c in clients]
    elif corruption == "partition":
        info["partition-id"] = nparts
    elif corruption == "examples-nan":
        info["num-examples"] = [float("nan")] * len(clients)
    elif corruption == "examples-huge":
        info["num-examples"] = [1e39] * len(clients)
    elif corruption == "examples-negative":
        info["num-examples"] = [-1.0] * len(clients)
    elif corruption == "units-huge":
        info["eval-units"] = [1.7e308, 1.0]
    elif corruption == "units-short":
        info["eval-units"] = [1.0]
    elif corruption == "num-clients":
        info["num-clients"] = 10 ** 12
    elif corruption == "torch":
        info["torch"] = 2
    elif corruption == "missing":
        info.pop("clients")
    elif corruption == "extra":
        info["w"] = 1.0
    elif corruption == "strings":
        info["clients"] = [str(c) for c in clients]
    content = RecordDict({"info": MetricRecord({"torch": 0}) if corruption == "record-kind"
                          else ConfigRecord(info)})
    if corruption == "theta0-junk":
        content["junk"] = ConfigRecord({"a": 1})
    try:
        got = decode_describe(content)
    except Exception as e:  # noqa: BLE001 - checked to be the one-line WireFormatError
        assert corruption is not None, f"valid description refused: {e}"
        _one_line_reason(e)
        return
    assert corruption is None, f"invalid description accepted: {corruption}"
    assert got["clients"] == clients and got["partition-id"] == part


# -- crafted checkpoints ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def saved_checkpoint(tmp_path_factory):
    """A real ServerApp checkpoint (FFGG + Adam on least squares, θ and moments) as the
    metadata of its two files (``{"pointer": …, "server": …}``) and every file's bytes, the
    run config and the fresh state a resumed run compares it with."""
    from partialfl import io as pio
    from partialfl.build import build
    from partialfl.flower.checkpoint import SYNC_CHECKPOINT, FlowerCheckpoint
    from partialfl.flower.config import parse_run_config
    from partialfl.flower.report import Failure, FlowerRunReport

    d = tmp_path_factory.mktemp("ckpt")
    spec = {"problem": {"name": "least-squares", "num_clients": 4, "n": 20, "d_theta": 3,
                        "d_w": 2}, "personalize": {"server": {"optimizer": "adam", "lr": 0.1}}}
    cfg = parse_run_config({"spec": spec, "out-dir": str(d)})
    built = build(cfg.run)
    problem, alg = built.problem, built.algorithm
    fresh = alg.init(problem, problem.init_theta())
    report = FlowerRunReport({}, fresh.theta, failures=[Failure(1, "error", 0, [1], "x")],
                             requested_client_updates=8)
    FlowerCheckpoint(cfg, report, fresh).save(fresh, None, [{"round": 0}], 4,
                                              {"clients_failed": 1})
    _, ptr = pio.load_tensors(d / SYNC_CHECKPOINT)
    _, server = pio.load_tensors(d / ptr["files"]["server"]["name"])
    files = {f.name: f.read_bytes() for f in d.iterdir()}
    return cfg, fresh, {"pointer": ptr, "server": server}, files


def write_checkpoint(folder, meta: dict, files: dict) -> None:
    """The checkpoint of ``files`` with the metadata ``meta`` (the server file's tensors
    kept; the pointer records the rewritten server file's SHA-256 unless ``meta`` changed
    that entry)."""
    from partialfl import io as pio
    from partialfl.flower.checkpoint import SYNC_CHECKPOINT

    for f in folder.iterdir():
        f.unlink()
    for name, data in files.items():
        (folder / name).write_bytes(data)
    ptr = json.loads(files_meta(files, SYNC_CHECKPOINT))
    name = ptr["files"]["server"]["name"]
    tensors, _ = pio.load_tensors(folder / name)
    sha = pio.save_tensors(folder / name, tensors, meta["server"])
    pointer = meta["pointer"]
    entry = pointer.get("files", {}).get("server") if isinstance(pointer.get("files"),
                                                                 dict) else None
    if isinstance(entry, dict) and entry.get("sha256") == ptr["files"]["server"]["sha256"]:
        entry["sha256"] = sha
    pio.save_tensors(folder / SYNC_CHECKPOINT, {}, pointer)


def files_meta(files: dict, name: str) -> str:
    """The partialfl metadata (JSON text) of file ``name`` among ``files``' bytes."""
    import struct

    data = files[name]
    n = struct.unpack("<Q", data[:8])[0]
    return json.dumps(json.loads(json.loads(data[8:8 + n])["__metadata__"]["partialfl"])
                      ["metadata"])


JSON = st.recursive(st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70)
                    | st.floats(allow_nan=True) | st.text(max_size=8),
                    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c,
                                                                        max_size=3),
                    max_leaves=8)


def _paths(tree, prefix=()):
    yield prefix
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from _paths(v, (*prefix, i))


def _load(cfg, fresh):
    from partialfl.flower.checkpoint import FlowerCheckpoint
    from partialfl.flower.report import FlowerRunReport

    ck = FlowerCheckpoint(cfg, FlowerRunReport({}, fresh.theta), fresh)
    return ck, ck.load()


@settings(max_examples=200, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(pick=st.integers(0, 10 ** 6), value=JSON, delete=st.booleans())
def test_crafted_checkpoint_loads_or_is_one_checkpoint_error(saved_checkpoint, pick, value,
                                                             delete):
    """One entry anywhere in the metadata of the pointer or of the server file (the state's
    skeleton, the report, the fingerprint, the file names and hashes, ...) replaced by random
    JSON or deleted: the checkpoint loads into a state usable as the fresh one, or resuming is
    refused with one line (CheckpointError) — never another exception."""
    from pathlib import Path

    from partialfl.flower.checkpoint import CheckpointError
    from partialfl.runtime.resume_check import signature

    cfg, fresh, meta, files = saved_checkpoint
    meta = json.loads(json.dumps(meta))
    paths = [q for q in _paths(meta) if len(q) >= 2]  # an entry of the pointer or server
    path = paths[pick % len(paths)]
    parent = meta
    for p in path[:-1]:
        parent = parent[p]
    if delete and isinstance(parent, dict):
        parent.pop(path[-1])
    else:
        parent[path[-1]] = value
    write_checkpoint(Path(cfg.out_dir), meta, files)
    try:
        ck, (state, client, history, grads, faults) = _load(cfg, fresh)
    except CheckpointError as e:
        hypothesis.event("refused")
        assert str(e) and "\n" not in str(e) and len(str(e)) < 500
        return
    hypothesis.event("loaded")
    # loaded: it must be usable as the fresh state is
    assert signature(state.theta) == signature(fresh.theta)
    assert signature(state.opt_state) == signature(fresh.opt_state)
    assert all(type(v) in (int, float) for k, v in state.extra.items() if k not in fresh.extra)
    assert client is None and isinstance(history, list) and type(grads) is int
    assert all(isinstance(f.clients, list) for f in ck.report.failures)


def test_the_uncrafted_checkpoint_loads(saved_checkpoint):
    from pathlib import Path

    from partialfl.runtime.resume_check import signature

    cfg, fresh, meta, files = saved_checkpoint
    write_checkpoint(Path(cfg.out_dir), json.loads(json.dumps(meta)), files)
    ck, (state, _, history, grads, faults) = _load(cfg, fresh)
    assert state.round == 0 and grads == 4 and history == [{"round": 0}]
    assert faults == {"clients_failed": 1} and ck.report.requested_client_updates == 8
    assert [f.reason for f in ck.report.failures] == ["x"]
    assert signature(state.opt_state) == signature(fresh.opt_state)
