"""Timing: exchange timetables (scheduler and verifier), the AMP microbenchmark and the calibration table."""

from tremula.timing.timetable import Timetable, schedule_exchange
from tremula.timing.verify import TimetableError, chunk_segments, replay_order, verify_timetable

__all__ = ["Timetable", "TimetableError", "chunk_segments", "replay_order", "schedule_exchange", "verify_timetable"]
