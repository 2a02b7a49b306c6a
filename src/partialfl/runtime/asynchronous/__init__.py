"""Asynchronous training (the paper's Algorithm 3), on a simulated clock or on a transport.

``concurrency`` clients are active at any time. Each active client computes its update from
the θ it received (``algorithm.client_update`` on a cohort of one, with
``RoundContext(seed, job, mode)``); when it finishes, the server applies the update at once
(``algorithm.server_update``) and hands the free slot to a newly sampled client, uniformly
among the clients not currently active (``generator(seed, "sample", job)``). With
``concurrency = M`` every client restarts as soon as it finishes.

Compute times come from a :class:`ComputeTimeModel`: a per-job distribution (one for all
clients, or one per client), an optional per-example distribution summed over the client's
examples, and a per-client device speed (time = work / speed), each drawn from
``generator(seed, "compute-time", job)``. Distributions are registered components (kind
``distribution``: constant, exponential, half-normal, log-normal, pareto;
:mod:`~partialfl.runtime.asynchronous.timing`).

The *staleness* (delay) of an applied update is the number of server steps (changes of
``state.round``) between the moment its client received θ and the moment it arrived. It is
recorded for every arrival, and the event log lists every dispatch and arrival in order, so
delays can be recounted independently. The loop is written once, :func:`drive`, over a
transport (:class:`AsyncTransport`): :class:`SimulatedClock`, worker processes
(:mod:`partialfl.runtime.processes`), Flower; the bookkeeping is :class:`AsyncServer`
(:mod:`~partialfl.runtime.asynchronous.server`). :func:`run_arrivals` runs a
:class:`~partialfl.runtime.run.Run`; :func:`run_async` is its keyword form.

Faults (:mod:`partialfl.runtime.faults`): a client that raises, or whose update is not
finite, is skipped and counted (event ``lost``, counters in every record), its slot goes to
a newly sampled client at once; the run aborts only past ``max_failure_fraction``. A data
error (a corrupt client store) stops the run.
"""

from partialfl.runtime.asynchronous.loop import (
    AsyncTransport,
    Event,
    SimulatedClock,
    drive,
    run_arrivals,
    run_async,
)
from partialfl.runtime.asynchronous.server import (
    EVENT_FIELDS,
    AsyncCheckpoint,
    AsyncRunResult,
    AsyncServer,
    Job,
    recount_staleness,
)
from partialfl.runtime.asynchronous.timing import (
    ComputeTimeModel,
    Constant,
    Distribution,
    Duration,
    Exponential,
    HalfNormal,
    LogNormal,
    Pareto,
    device_speeds,
    synchronous_round_times,
)

__all__ = ["EVENT_FIELDS", "AsyncCheckpoint", "AsyncRunResult", "AsyncServer", "AsyncTransport",
           "ComputeTimeModel", "Constant", "Distribution", "Duration", "Event", "Exponential",
           "HalfNormal", "Job", "LogNormal", "Pareto", "SimulatedClock", "device_speeds",
           "drive", "recount_staleness", "run_arrivals", "run_async",
           "synchronous_round_times"]
