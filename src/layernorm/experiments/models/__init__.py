"""Models shared by more than one experiment (an experiment's own model stays in its module)."""
