"""Running marl on one machine: the process launcher, a private Redis and the demo."""
