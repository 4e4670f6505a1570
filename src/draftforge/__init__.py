"""draftforge: curate → extract → train → evaluate → baselines → report for DFlash/DDTree drafters.

Keep this package root import-light: the Snakefile imports `draftforge.config` and `draftforge.paths`
and must never pull in torch.
"""

__version__ = "0.1.0"
