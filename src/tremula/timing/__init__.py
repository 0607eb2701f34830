"""Timing: exchange timetables (scheduler and verifier) and the AMP and matmul-vertex microbenchmarks (calibration
against published measurements, which compiles whole models, is the driver's: tremula/calibrate.py)."""

from tremula.timing.timetable import Timetable, schedule_exchange
from tremula.timing.verify import TimetableError, chunk_segments, replay_order, verify_timetable

__all__ = ["Timetable", "TimetableError", "chunk_segments", "replay_order", "schedule_exchange", "verify_timetable"]
