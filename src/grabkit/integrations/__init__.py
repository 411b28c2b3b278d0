"""Adapters for training frameworks; each submodule imports its framework, this package does not.

* :mod:`grabkit.integrations.huggingface`  ``GrabkitTrainer``: GraB order, adaptive accumulation
  and noise-scale logging in a Hugging Face ``Trainer`` (``pip install grabkit[huggingface]``)
* :mod:`grabkit.integrations.lightning`    Lightning ``Callback``s (``grabkit[lightning]``)
* :mod:`grabkit.integrations.accelerate`   ``adaptive_step``, ``SamplerCheckpoint`` and
  ``shard_by_sampler`` for a hand-written accelerate loop (imports nothing from accelerate)
* :mod:`grabkit.integrations.resume`       framework-free sampler states that resume exactly when
  the framework prefetched batches, or replays and skips the interrupted epoch
* :mod:`grabkit.integrations.schedule`     ``RealUpdateSchedule``: an LR schedule counted in the
  adaptive wrapper's real updates (Lightning)
* :mod:`grabkit.integrations.trainer_noise` the noise scale of Trainer's windows, weighted as
  Trainer weights them (one process or DDP)
* :mod:`grabkit.integrations.grouped_forward` ``GroupedForward``: a transformers model's body run
  by length groups on right-padded batches
* :mod:`grabkit.integrations.example_norms` per-example gradient norms for a training log
* :mod:`grabkit.integrations.wiring`       framework objects in the call stack: warnings for the
  obvious wiring without an integration, and the refusal of accelerate re-splitting a GraB loader
"""

__all__: list[str] = []
