"""Fault-injection scenarios against real processes; :mod:`.faults` is the fault library."""
