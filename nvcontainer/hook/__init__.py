"""The programs an OCI runtime executes: ``nvcontainer-hook`` (prestart and the CDI hooks) and
its client, which hands a run to a resident ``nvcontainer serve`` when one listens."""
