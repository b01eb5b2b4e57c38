"""The flat app's own `tasks` package (a name the library once installed at the top level too)."""
