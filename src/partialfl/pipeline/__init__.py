"""The library below the reproductions: partially personalized training of a model on
federated data, and what is made of a finished run.

- :mod:`~partialfl.pipeline.stages`: the three-stage pipeline (FedAvg pre-training →
  personalization → fine-tuning), resumable, from one :class:`~partialfl.spec.RunSpec`;
- :mod:`~partialfl.pipeline.stopping`: stage budgets by a plateau rule and stage 3 chosen on
  validation data;
- :mod:`~partialfl.pipeline.evaluation`: pooled and per-client metrics, new-client
  evaluation of a finished run; :mod:`~partialfl.pipeline.runs`: of every run of a folder;
- :mod:`~partialfl.pipeline.files`: the run's tensor and JSON files, the deployed model;
  :mod:`~partialfl.pipeline.deploy`: every client's deployed model as a product;
- :mod:`~partialfl.pipeline.report`: markdown tables, plots, paired sections;
- :mod:`~partialfl.pipeline.train` / :mod:`~partialfl.pipeline.train_report`: ``partialfl
  train`` and its report; :mod:`~partialfl.pipeline.closed_form`: ``partialfl run`` on a
  closed-form problem; :mod:`~partialfl.pipeline.jobs`: many runs in worker processes;
- :mod:`~partialfl.pipeline.study`: a study (``train --seeds/--sweep``), its runs in worker
  processes; :mod:`~partialfl.pipeline.compare`: ``partialfl compare`` (runs grouped by
  configuration minus seed, paired intervals); :mod:`~partialfl.pipeline.trackers`: W&B and
  MLflow runs of a finished run.

It sits on the core (spec, build, algorithms, runtime, data, models) and below
:mod:`partialfl.reproductions`, :mod:`partialfl.flower` and the CLI: nothing here imports
them.
"""
