"""A run's history read back from its events: its attempts (`timeline`) and where its wall
time went (`goodput`), on one clock (`clocks`: the hub's). Pure functions of the events, shared
by `baton report`, `baton status`, `baton goodput`, the dashboard and the reaper's metrics."""
