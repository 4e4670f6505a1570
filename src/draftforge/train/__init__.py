"""`train` stage (see DESIGN.md §3)."""
