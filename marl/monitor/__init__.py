"""Watching runs: the live view, the HTML report, trace summaries and progress."""
