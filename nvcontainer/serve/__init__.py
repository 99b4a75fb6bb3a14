"""``nvcontainer serve``: the hook's code imported once, its inventory warm, one forked child
per request on a root-only socket."""
