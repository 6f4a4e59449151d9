"""The per-node daemon: registration, heartbeats, local health, process supervision, drills."""
