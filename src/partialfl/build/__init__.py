"""The one builder: a run specification (:class:`partialfl.spec.RunSpec`) → the objects that
run it, for ``partialfl run`` / ``train``, the pipeline, the reproductions and the Flower app.

Every name is resolved by the registry (:mod:`partialfl.registry`); what differs per component
is a field or a trait of its entry, never a name check here. :func:`build` makes a
:class:`Run` (:mod:`~partialfl.build.run`): a closed-form run's problem and algorithm, or a
model run's task, its new clients and the plan ``--dry-run`` prints. The pieces —
:mod:`~partialfl.build.algorithm` (one stage's algorithm with its wrappers),
:mod:`~partialfl.build.problem`, :mod:`~partialfl.build.task` (model, split, data, loss),
:mod:`~partialfl.build.names` (components by name for the Python API) and
:mod:`~partialfl.build.code` (code named by configs only with ``--allow-code``) — are what
the pipeline and Flower call.
"""

from partialfl.build.algorithm import (
    async_rule,
    build_aggregator,
    build_algorithm,
    build_server_opt,
    stage_algorithm,
    wrap_algorithm,
)
from partialfl.build.code import (
    ALLOW_CODE_ENV,
    allow_code,
    code_allowed,
    config_folder_on_path,
    load_spec_plugins,
)
from partialfl.build.names import (
    convert_data,
    make_aggregator,
    make_attack,
    make_backend,
    make_optimizer,
    make_solver,
)
from partialfl.build.problem import build_problem, executor_of, problem_of
from partialfl.build.run import Run, build, model_task, task_name
from partialfl.build.task import (
    Task,
    build_data,
    build_loss_metric,
    build_model,
    build_split,
    import_callable,
    make_model,
    split_of,
)

__all__ = ["ALLOW_CODE_ENV", "Run", "Task", "allow_code", "async_rule", "build",
           "build_aggregator", "build_algorithm", "build_data", "build_loss_metric",
           "build_model", "build_problem", "build_server_opt", "build_split", "code_allowed",
           "config_folder_on_path", "convert_data", "executor_of", "import_callable",
           "load_spec_plugins", "make_aggregator", "make_attack", "make_backend", "make_model",
           "make_optimizer", "make_solver", "model_task", "problem_of", "split_of",
           "stage_algorithm", "task_name", "wrap_algorithm"]
