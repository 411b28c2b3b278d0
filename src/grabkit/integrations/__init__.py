"""Adapters for training frameworks; each submodule imports its framework, this package does not.

* :mod:`grabkit.integrations.huggingface`  ``GrabkitTrainer``: GraB order, adaptive accumulation
  and noise-scale logging in a Hugging Face ``Trainer`` (``pip install grabkit[huggingface]``)
* :mod:`grabkit.integrations.lightning`    Lightning ``Callback``s (``grabkit[lightning]``)
* :mod:`grabkit.integrations.accelerate`   ``adaptive_step`` and ``SamplerCheckpoint`` for a
  hand-written accelerate loop (imports nothing from accelerate)
* :mod:`grabkit.integrations.resume`       framework-free sampler states that resume exactly when
  the framework prefetched batches, or replays and skips the interrupted epoch
* :mod:`grabkit.integrations.schedule`     ``RealUpdateSchedule``: an LR schedule counted in the
  adaptive wrapper's real updates
"""

__all__: list[str] = []
