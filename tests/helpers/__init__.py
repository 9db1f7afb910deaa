"""What the tests share: tiny models (models.py), building and training a CPU trainer (training.py),
recipe runs through the command line (recipes.py), the rank processes of the multi-process tests
(*_worker.py), and hooks/ for real `orttrainer train` processes."""
