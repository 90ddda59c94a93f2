"""Example third-party specla plugin (see README.md beside this package)."""
