"""The operator's settings: the configuration file, strictly checked, as one immutable Config."""
