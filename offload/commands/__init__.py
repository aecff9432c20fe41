"""Small CLI commands that have no package of their own."""
