"""tunerctl: the command-line client. Commands live one module each and load lazily."""
