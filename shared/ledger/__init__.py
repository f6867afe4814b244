"""Credits: a prepaid ledger per owner (docs/scheduling.md, "Credits").

`book` stores entries once each and folds an owner's into its balance; `charges` reads
what an ended run is charged from its events; `holds` reckons and takes a run's hold as
the dispatcher accepts or resumes it."""
