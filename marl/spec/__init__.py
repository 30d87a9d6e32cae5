"""The bottom layer: the RunSpec, every service's typed config, input limits and the user's errors."""
