"""Command-line interface: one thin module per command, mounted by `app.py`."""
