"""Running a job: local processes (demo, tests, chaos), a warm standby trainer, and exit codes for schedulers.

``python -m torchft_lite.launch`` and the torchx components (:mod:`torchft_lite.torchx`) are the entry points.
"""
