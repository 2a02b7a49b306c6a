"""Model problems: a torch model, a split into global θ and personal w, and federated data.

Client m's loss is the mean over its training examples,

    f_m(θ, w) = Σ_i ℓ(h(x_i; θ, w), y_i) / Σ_i d_i,

where ``loss_fn(output, y)`` returns per-example losses ℓ (then d_i = 1) or a pair
``(ℓ_i, d_i)`` (e.g. summed token losses and token counts for next-word prediction). The model
h is evaluated functionally on ONE shared module, ``torch.func.functional_call(module,
{**θ, **w}, x)``, so every client uses the same module object and clients can be batched.

Everything is batched over a *cohort* (positions 0..M-1 of the FederatedDataset): w trees carry
a leading client axis ``[k, ...]``; θ is either shared (the parameter's own shape) or per
client (``[k, ...]``, e.g. during local θ-steps). Two execution paths give the same numbers:

* vectorised (a :class:`~partialfl.batching.Vmap` mode, a group of k > 1 clients):
  ``torch.func.vmap`` over the clients, with each client's minibatch padded to a common size
  and masked (masked examples add exact zeros to the loss and its gradient; a client with
  nothing left this step gets a zero gradient);
* plain (a :class:`~partialfl.batching.Loop` mode, or a group of one client): one client, no
  padding.

The mode is the caller's: every cohort computation takes ``mode=`` (a run's loop passes its
executor's, through ``RoundContext.mode``, the algorithm and the local trainer);
:func:`partialfl.batching.map_clients` groups the clients as it says, and each computation
only supplies its vmapped kernel and its one-client kernel
(:mod:`~partialfl.problems.model.passes`, :mod:`~partialfl.problems.model.kernels`). The
problem's own ``mode`` is only the default of calls made outside a run (evaluation, tests).

Dropout is off (the module is put in ``eval()`` mode). Other buffers are constants of the
module, except the running statistics of normalization layers (BatchNorm's ``running_mean``,
``running_var``, ``num_batches_tracked``): those are **personal client state** s_m. They
travel in the personal tree next to w (``init_w`` returns them, names in
:attr:`ModelProblem.state_names`), are never differentiated and never part of θ, so no
update sent to the server contains them. A minibatch step (:meth:`minibatch_grads`) runs the
normalization layers in train mode — the batch's own statistics, with s_m updated by the
layer's momentum rule and returned with ``with_state=True`` — and the vectorised path then
groups clients by minibatch size instead of padding (padding would change the batch
statistics), so it takes the same steps as the plain path (with ``precision`` bf16/fp16 these
steps run client by client: torch cannot differentiate a train-mode BatchNorm under vmap and
autocast). Full-data passes (loss, ∇θ, ∇w, metrics) use eval mode: f_m(θ, w, s_m)
normalizes with the client's running statistics.
A BatchNorm without running statistics (``track_running_stats=False``) is refused (its
evaluation would depend on how the data is chunked).

Devices and precision (:mod:`partialfl.devices`): the module, θ and w live on ``device``; the
data stays in (pinned) host memory and each minibatch is copied with a non-blocking transfer,
unless it is small enough to be kept on the device whole (``data_on_device``). ``precision``
``bf16``/``fp16`` runs the forward pass under ``torch.autocast`` (fp16 with dynamic loss
scaling); parameters and gradients stay fp32. All randomness comes from CPU generators, so a
run takes the same steps on every device.

Modules: :mod:`~partialfl.problems.model.problem` (the problem: construction, the problem
protocol), :mod:`~partialfl.problems.model.passes` (computations over a cohort under a mode),
:mod:`~partialfl.problems.model.kernels` (per-batch kernels, vmapped and plain),
:mod:`~partialfl.problems.model.data` (the clients' examples as flat tensors),
:mod:`~partialfl.problems.model.modules` (normalization state, re-initialisation),
:mod:`~partialfl.problems.model.losses` (losses and metrics).
"""

from partialfl.problems.model.data import padded_rows
from partialfl.problems.model.losses import (
    LossFn,
    Metric,
    accuracy,
    cross_entropy,
    masked_token_accuracy,
)
from partialfl.problems.model.problem import ModelProblem, default_mode

__all__ = ["LossFn", "Metric", "ModelProblem", "accuracy", "cross_entropy", "default_mode",
           "masked_token_accuracy", "padded_rows"]
