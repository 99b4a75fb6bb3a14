"""``nvcontainer``, the operator's command line: one module per command, click only here."""
