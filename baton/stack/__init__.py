"""Baton on one machine: the embedded stack `baton up` starts (`embedded`), with the
nats-server (`natsserver`, `natsconf`) and process management (`procs`) it alone uses."""
