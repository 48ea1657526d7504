"""``ksim trace``: programs in a subset of bpftrace's language, compiled to snippets.

``parser`` reads a program into the tree of ``syntax``; ``compiler`` checks it and
lowers each probe's action to one snippet per point, with maps laid out in the
kernel's data heap by ``maps`` and printf's events going through the ring of
``events``; ``session`` splices everything through a Manager and runs BEGIN and
END in the client; ``output`` prints maps the way bpftrace's language does.
``ksim.commands.trace`` is the command (docs/trace.md).
"""
