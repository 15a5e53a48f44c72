"""What every feature stands on: the feature registry, declared and reversible patches (one
per upstream attribute), the save in progress, the agreement that turns local facts into one
decision on every rank, the exception root, and the rehearsals the patches' probes run."""
