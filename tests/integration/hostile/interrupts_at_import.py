"""A module whose top level raises KeyboardInterrupt."""

raise KeyboardInterrupt("from a module's top level")
