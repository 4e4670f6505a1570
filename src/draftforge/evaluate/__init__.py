"""`evaluate` stage (see DESIGN.md §3)."""
