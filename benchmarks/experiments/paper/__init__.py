"""GraB at its authors' own settings: MNIST logistic regression, LeNet on CIFAR-10, an LSTM LM.

The settings follow the scripts of Lu, Guo and De Sa (NeurIPS 2022), github.com/EugeneLYC/GraB,
``neurips22/examples/`` (``vision/lg_mnist.sh``, ``vision/lenet_cifar10.sh``,
``nlp/word_language_model/lstm_wiki.sh`` and the Python they call); ``SETTINGS.md`` beside the
results lists each setting with its source and where grabkit's defaults differ. Tasks:
``vision`` (MNIST, CIFAR-10), ``lstm`` (PTB); per-run records and resume: ``records``; tables
and figures: ``report``; the command line: ``python -m benchmarks.experiments.paper``.
"""
