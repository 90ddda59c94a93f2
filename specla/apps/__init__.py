"""The applications on top of the library: the ``specla`` command (``cli``) and what its
subcommands run (``demo``, ``bench``, ``train_drafter``). Nothing in the library or the plugins
imports this package (tests/core/test_layering.py checks it); importing it loads nothing, so that the
command parses its arguments before torch loads."""
