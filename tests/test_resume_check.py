"""A resumed in-process run checks what it read against this run (issue 21, after round 7):
the Flower ServerApps checked their checkpoints, but ``run_rounds``/``run_async`` (and so
``partialfl run --resume``) continued from whatever a checkpoint whose pointer was rewritten
with it held. Each crafted file is now one :class:`CheckpointError` line; an untouched one
still resumes bit-identically (tests/test_checkpoint.py)."""

from __future__ import annotations

import shutil
from dataclasses import replace

import numpy as np
import pytest
from conftest import SMALL

from partialfl import io as pio
from partialfl.algorithms import Scaffold
from partialfl.algorithms.asynchronous import FedBuff
from partialfl.problems.least_squares import LeastSquaresProblem
from partialfl.runtime import run_rounds
from partialfl.runtime.asynchronous import ComputeTimeModel, Distribution, run_async
from partialfl.runtime.checkpoint import Checkpoint
from partialfl.runtime.resume_check import CheckpointError


def _rewrite(path, kind: str, edit) -> None:
    """Decode the committed generation of the checkpoint at ``path``, let ``edit(server,
    client)`` change it, and commit it again under the same fingerprint (what a pointer
    rewritten along with its files looks like: every hash matches)."""
    _, ptr = pio.load_tensors(path)
    ck = Checkpoint(path, ptr["fingerprint"], kind=kind, private=True)
    saved = ck.load()
    server, client = edit(saved.server, saved.client)
    ck.save(server, client, extra=saved.extra, progress=ptr.get("progress"))


def _refused(template, tmp_path, name: str, kind: str, edit, run) -> None:
    """A copy of the template's checkpoint rewritten by ``edit`` is refused on resume with
    one CheckpointError line naming the checkpoint."""
    p, tmpl = template
    d = tmp_path / "ck"
    shutil.copytree(tmpl, d)
    _rewrite(d / name, kind, edit)
    with pytest.raises(CheckpointError) as e:
        run(p, d / name, resume=True)
    assert "\n" not in str(e.value) and name in str(e.value), str(e.value)


def _theta(edit):
    def f(server, client):
        st = server["state"]
        server["state"] = replace(st, theta={n: edit(v) for n, v in st.theta.items()})
        return server, client
    return f


def _server(key, value):
    def f(server, client):
        server[key] = value
        return server, client
    return f


def _clients(edit):
    def f(server, client):
        return server, edit(dict(client))
    return f


def _first(cs, value):
    n = sorted(cs)[0]
    cs[n] = value(cs[n])
    return cs


SYNC = {
    "theta-nan": _theta(lambda v: np.full_like(v, np.nan)),
    "theta-shape": _theta(lambda v: np.zeros(3)),
    "theta-dtype": _theta(lambda v: v.astype(np.float32)),
    "round-past-the-run": lambda s, c: (_server("state", replace(s["state"], round=50))(s, c)),
    "round-negative": lambda s, c: (_server("state", replace(s["state"], round=-2))(s, c)),
    "history-of-ints": _server("history", [3, 4]),
    "history-rounds-ahead": _server("history", [{"round": 7}]),
    "grad-evals-negative": _server("grad_evals", -4),
    "grad-evals-text": _server("grad_evals", "x"),
    "faults-malformed": _server("faults", {"clients_failed": "many"}),
    "server-not-a-state": _server("state", {"theta": 1}),
    "clients-missing": lambda s, c: (s, None),
    "clients-leaf-missing": _clients(lambda cs: {n: v for n, v in list(cs.items())[1:]}),
    "clients-leaf-extra": _clients(lambda cs: {**cs, "w_spy": np.zeros(3)}),
    "clients-rows": _clients(lambda cs: _first(cs, lambda v: v[:2])),
    "clients-nan": _clients(lambda cs: _first(cs, lambda v: np.full_like(v, np.nan))),
    "clients-dtype": _clients(lambda cs: _first(cs, lambda v: v.astype(np.float32))),
}


def _sync(p, ckpt, resume=False):
    return run_rounds(p, Scaffold(3), 2, clients_per_round=3, seed=1, checkpoint=ckpt,
                      checkpoint_every=1, resume=resume,
                      evaluate=lambda *a: {"n": float(a[1].round)})


@pytest.fixture(scope="module")
def sync_template(tmp_path_factory):
    p = LeastSquaresProblem(SMALL, basis="standard")
    d = tmp_path_factory.mktemp("sync")
    _sync(p, d / "run.ckpt")
    return p, d


@pytest.mark.parametrize("variant", sorted(SYNC))
def test_a_crafted_synchronous_checkpoint_is_refused_in_one_line(variant, sync_template,
                                                                 tmp_path):
    _refused(sync_template, tmp_path, "run.ckpt", "sync", SYNC[variant], _sync)


def test_the_untouched_rewritten_checkpoint_resumes(sync_template, tmp_path):
    """The crafting itself changes nothing the checks look at: rewritten unedited, the
    checkpoint resumes to the run's final θ."""
    p, tmpl = sync_template
    d = tmp_path / "ck"
    shutil.copytree(tmpl, d)
    _rewrite(d / "run.ckpt", "sync", lambda s, c: (s, c))
    res = _sync(p, d / "run.ckpt", resume=True)
    ref = run_rounds(p, Scaffold(3), 2, clients_per_round=3, seed=1)
    for n, v in ref.state.theta.items():
        np.testing.assert_array_equal(res.state.theta[n], v)


# -- asynchronous -------------------------------------------------------------------------
def _snap(edit):
    def f(server, client):
        edit(server["server"])
        return server, client
    return f


def _job(i, value):
    def f(server, client):
        j, st = server["jobs"][0]
        j = list(j)
        j[i] = value
        server["jobs"][0] = (tuple(j), st)
        return server, client
    return f


def _job_theta(server, client):
    j, st = server["jobs"][0]
    server["jobs"][0] = (j, replace(st, theta={n: np.full_like(v, np.nan)
                                               for n, v in st.theta.items()}))
    return server, client


def _free_first_job(server, client):
    server["server"]["busy"][server["jobs"][0][0][1]] = False
    return server, client


def _sent_rows(edit):
    def f(server, client):
        client["rows"][0] = edit(dict(client["rows"][0]))
        return server, client
    return f


def _async_clients(edit):
    def f(server, client):
        client["client_state"] = edit(dict(client["client_state"]))
        return server, client
    return f


ASYNC = {
    "theta-nan": _snap(lambda s: s.__setitem__("state", replace(
        s["state"], theta={n: np.full_like(v, np.nan) for n, v in s["state"].theta.items()}))),
    "arrivals-huge": _snap(lambda s: s.__setitem__("arrivals", 10**6)),
    "busy-length": _snap(lambda s: s.__setitem__("busy", np.zeros(2, bool))),
    "time-negative": _snap(lambda s: s.__setitem__("time", -1.0)),
    "job-client-out-of-range": _job(1, 99),
    "job-client-not-busy": _free_first_job,
    "job-slot-out-of-range": _job(2, 9),
    "job-version-ahead": _job(4, 99),
    "job-arity": lambda s, c: ({**s, "jobs": [((1, 2), st) for _, st in s["jobs"]]}, c),
    "job-theta-nan": _job_theta,
    "jobs-and-rows-differ": lambda s, c: (s, {**c, "rows": c["rows"][1:]}),
    "sent-rows-shape": _sent_rows(lambda cs: _first(cs, lambda v: np.zeros((3, *v.shape[1:]),
                                                                            v.dtype))),
    "sent-rows-nan": _sent_rows(lambda cs: _first(cs, lambda v: np.full_like(v, np.nan))),
    "clients-nan": _async_clients(lambda cs: _first(cs, lambda v: np.full_like(v, np.nan))),
    "clients-rows": _async_clients(lambda cs: _first(cs, lambda v: v[:2])),
    "clients-leaf-missing": _async_clients(lambda cs: dict(list(cs.items())[1:])),
}


def _async(p, ck, resume=False):
    return run_async(p, FedBuff(Scaffold(tau=2), buffer_size=2), steps=6, concurrency=3,
                     seed=2, eval_every=2, checkpoint=ck, checkpoint_every=2, resume=resume,
                     compute_time=ComputeTimeModel(Distribution("exponential", 1.0)))


@pytest.fixture(scope="module")
def async_template(tmp_path_factory):
    p = LeastSquaresProblem(SMALL, basis="standard")
    d = tmp_path_factory.mktemp("async")

    class Stop(Exception):
        pass

    # stop the run after its second checkpoint, jobs still in flight
    ck = d / "a.ckpt"
    with pytest.MonkeyPatch.context() as mp:
        from partialfl.runtime.asynchronous import server as srv

        real, n = srv.AsyncCheckpoint.save, []

        def save(self, server, inflight):
            real(self, server, inflight)
            n.append(len(inflight))
            if len(n) == 2:
                raise Stop

        mp.setattr(srv.AsyncCheckpoint, "save", save)
        with pytest.raises(Stop):
            _async(p, ck)
    assert n[-1] >= 1  # jobs were in flight when it stopped
    return p, d


@pytest.mark.parametrize("variant", sorted(ASYNC))
def test_a_crafted_asynchronous_checkpoint_is_refused_in_one_line(variant, async_template,
                                                                  tmp_path):
    _refused(async_template, tmp_path, "a.ckpt", "async", ASYNC[variant], _async)


def test_the_untouched_asynchronous_checkpoint_resumes_to_the_full_run(async_template,
                                                                       tmp_path):
    p, tmpl = async_template
    d = tmp_path / "ck"
    shutil.copytree(tmpl, d)
    _rewrite(d / "a.ckpt", "async", lambda s, c: (s, c))
    res = _async(p, d / "a.ckpt", resume=True)
    full = _async(p, tmp_path / "full.ckpt")
    for n, v in full.state.theta.items():
        np.testing.assert_array_equal(res.state.theta[n], v)
    assert res.events == full.events
