"""ddpkit.diagnostics: environment report and live checks."""
