"""`baton ui`: the operator's live dashboard (server.py), fed by the runs bucket (index.py),
the trainers' heartbeats and a run's events (live.py, views.py)."""
