"""`extract` stage (see DESIGN.md §3)."""
