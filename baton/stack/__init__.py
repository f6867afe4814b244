"""Baton on one machine: the stack `baton up` starts, one room per concern — what a stack
is (`options`), which services it runs (`services`), its authority: credentials,
authorization and people (`authority`, `people`), its servers (`servers`, over `natsserver`,
`natsconf`, `cluster`, `routes`) and its lifecycle: start, supervise, stop (`lifecycle`,
over `procs`)."""
