"""Health checks: what keeps bad state from spreading, and a hung group from stalling everyone.

:mod:`.nonfinite` the non-finite guard and :class:`HealthConfig`; :mod:`.fingerprint` replica fingerprints
and :mod:`.fingerprint_vote` the majority vote on them (silent data corruption); :mod:`.watchdog` section
timeouts and :mod:`.watchdog_calibration` their calibration from observed durations.
"""

from torchft_lite.health.nonfinite import (
    FINGERPRINT_EVERY_ENV, MAX_NONFINITE_STEPS_ENV, NONFINITE_GUARD_ENV, HealthConfig,
)

__all__ = ["FINGERPRINT_EVERY_ENV", "HealthConfig", "MAX_NONFINITE_STEPS_ENV", "NONFINITE_GUARD_ENV"]
