"""`curate` stage (see DESIGN.md §3)."""
