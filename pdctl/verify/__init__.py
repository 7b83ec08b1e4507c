"""`pdctl verify`: token-exact checks of a PD topology, with diagnosis and reports."""
