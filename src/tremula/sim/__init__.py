"""Backends that execute a Program: the functional simulator."""
