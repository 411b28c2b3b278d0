"""Adapters for training frameworks; each submodule imports its framework, this package does not.

* :mod:`grabkit.integrations.huggingface`  ``GrabkitTrainer``: GraB order, adaptive accumulation
  and noise-scale logging in a Hugging Face ``Trainer`` (``pip install grabkit[huggingface]``)
* :mod:`grabkit.integrations.lightning`    Lightning ``Callback``s (``grabkit[lightning]``)
* :mod:`grabkit.integrations.resume`       framework-free helpers: a sampler state that resumes
  exactly when the framework re-reads (or skips) the interrupted epoch's batches
"""

__all__: list[str] = []
