"""Scenarios of the chaos matrix (filled in by their owner)."""

from __future__ import annotations

from .scenario import Scenario

SCENARIOS: list[Scenario] = []
