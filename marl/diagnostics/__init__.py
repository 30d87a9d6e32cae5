"""Role drift diagnostics: trajectory signatures from transcripts, alarms from metric series."""
